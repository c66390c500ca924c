"""Serving on a GPU as a TGI user buys one for: many concurrent requests of ShareGPT-like lengths, end to end
through the HTTP server, against transformers' batched `generate` on the same model in the same run.

    python3 -m bench serving --json $OUT/serving.json                    # H100/H200: Llama-3.1-8B's shape, bf16
    python3 -m bench serving --quantize fp8 --json $OUT/serving-fp8.json # the same with fp8 weights
    python3 -m bench serving --model tiny --device cpu --concurrency 1,4 --requests 8 --max-input 64 \\
        --max-output 24 --floor-requests 4                               # the CPU check (seconds)

Model. A random-weight Llama of Llama-3.1-8B's shape (bf16 on CUDA; `--model tiny`: the tests' 2-layer shape),
written once as a safetensors checkpoint (below: the LM head's EOS row is zero, so greedy
answers never end early, and a word-level tokenizer makes every prompt exactly its length in tokens). The server
is `kettle launch` on that folder, started as a user starts it (`--quantize` picks fp8/int8/int4 weights), with
limits that admit the whole mix and, on CUDA, a KV cache sized by the warmup from the GPU's free memory.

Requests. bench/data/sharegpt_lengths.json: 1,000 (input, output) token pairs drawn once (below,
log-normal, inputs 50-1,500, outputs 50-800); `--max-input/--max-output` scale the mix down for quick runs.
Each request is a greedy `/generate_stream` call with `max_new_tokens` = its output length and a prompt of its
own (random words, never a prefix-cache hit). Every answer's tokens are counted: an answer shorter than asked,
or a prompt the server counted differently, is listed after the table (none is expected).

Workloads, one after the other on one server after a warm-up: for each of `--concurrency` (1,16,64,256), a
closed loop of that many clients over the first `--per-client` x concurrency requests of the mix (each client
sends its next request when its answer ends); then `offline`: the whole mix (`--requests` caps every workload)
sent at once. Per row: output tok/s and requests/s (all answers' tokens and requests over the row's wall time),
TTFT and inter-token latency p50/p99 (client side, kettle/bench/loadgen.py's streaming client; TTFT includes
queueing), and the KV cache's use: /metrics' `kettle_kv_blocks_free` / `kettle_kv_blocks_total` sampled every
`--sample-every` seconds while the row runs, peak and mean fraction of blocks held by requests.

Floor: transformers' `generate` on the same checkpoint and dtype, offline over the first `--floor-requests`
requests of the mix (default: as many as the offline row, at most 256) in left-padded batches of `--floor-batch`
in mix order, greedy, `min_new_tokens` = `max_new_tokens` = the batch's longest answer (a static batch runs to
its longest); output tok/s counts the tokens the requests asked for, so the padding a static batch wastes is its
cost. It runs after the server has stopped (the GPU is its alone), after two untimed batches of a few steps, and
the ratio Kettle offline / transformers (output tok/s) is printed.
Dated numbers go to bench/GPU_RESULTS.md with the device and the command printed above the table.

The request mix: 1,000 (input tokens, output tokens) pairs shaped like ShareGPT's
conversations, written once to bench/data/sharegpt_lengths.json so that every run sends the same requests.

    .venv/bin/python -m bench.serving          # writes the file again (it must come out byte for byte the same)

Shape. ShareGPT's prompts and answers (as the serving benchmarks of vLLM and TGI sample them, Llama tokens) are
long-tailed: most prompts are a few hundred tokens, a few run to thousands; answers are a little shorter and
tail off the same way. Both are drawn here from log-normal distributions (the median and sigma below, the
log-normal's parameters being ln(median) and sigma) and clipped to the ranges a benchmark request keeps: inputs
50-1,500 tokens, outputs 50-800. Python's own `random.Random(MIX_SEED)` draws them (its log-normal is stable across
Python versions, unlike numpy's streams across numpy versions), input then output for each pair.

The model: a random-weight Llama checkpoint (tiny, or Llama-3.1-8B's shape) whose answers
always run to the length a request asks for, with a word-level tokenizer that makes a prompt of N words N tokens.

Forced lengths. TGI's API has no `ignore_eos`, and a random model may pick its end-of-sequence token at any step.
So the checkpoint's LM head has a zero row for EOS while every other row is random: EOS's logit is exactly 0 at
every step, and greedy decoding picks it only if all other logits are negative at once, which for random rows
(each as likely positive as negative) has a chance of 2^-(vocab - 1). Quantization keeps the row zero (a row's
scale is clamped above zero, and zero quantizes to zero). The benchmark still counts every answer's tokens and
reports any that came out short.

Exact prompt lengths. The tokenizer is word level: token i is the word `w{i}` (ids 0-2 are `<pad>`, `<s>`,
`</s>`), with no BOS added, so the prompt "w17 w230 ..." of N words is N tokens for the server and for
transformers alike, and its vocabulary is the model's whole embedding table (no id the model can pick is unknown
to the detokenizer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kettle.bench.loadgen import LoadResult, StreamTiming, session, stream_tokens
from kettle.bench.process import KettleServer

PATH = Path(__file__).parent / "data" / "sharegpt_lengths.json"
MIX_SEED = 20261129
COUNT = 1000
# (median, sigma, low, high) of each side's log-normal, clipped to [low, high].
INPUT = (250, 0.9, 50, 1500)
OUTPUT = (180, 0.75, 50, 800)


@dataclass(frozen=True)
class Request:
    """One request of the mix: its prompt's length and the tokens it asks for, in tokens."""

    input_tokens: int
    output_tokens: int


def draw(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return min(high, max(low, round(rng.lognormvariate(math.log(median), sigma))))


def generate(seed: int = MIX_SEED, count: int = COUNT) -> list[Request]:
    """The mix as the parameters above draw it."""
    rng = random.Random(seed)
    return [Request(draw(rng, *INPUT), draw(rng, *OUTPUT)) for _ in range(count)]


def document(requests: list[Request]) -> str:
    """The data file's text: the parameters that drew it, then one [input, output] pair per line."""
    header = {
        "about": "ShareGPT-like request lengths for `python -m bench serving`, drawn by bench/serving.py",
        "seed": MIX_SEED,
        "input": dict(zip(("median", "sigma", "low", "high"), INPUT, strict=True)),
        "output": dict(zip(("median", "sigma", "low", "high"), OUTPUT, strict=True)),
    }
    pairs = ",\n".join(f"    [{r.input_tokens}, {r.output_tokens}]" for r in requests)
    head = json.dumps(header, indent=2)[:-2]  # the header's fields, then the pairs in the same object
    return f'{head},\n  "pairs": [\n{pairs}\n  ]\n}}\n'


def load(path: Path = PATH) -> list[Request]:
    """The committed mix."""
    return [Request(i, o) for i, o in json.loads(path.read_text())["pairs"]]


def scaled(requests: list[Request], max_input: int | None, max_output: int | None) -> list[Request]:
    """The mix with each side scaled so its longest is at most `max_input` / `max_output` (None: as it is),
    keeping the shape: a quick run on a small model keeps long and short requests in the same proportions."""

    def scale(values: list[int], most: int | None) -> list[int]:
        top = max(values)
        if most is None or top <= most:
            return values
        return [max(1, round(v * most / top)) for v in values]

    inputs = scale([r.input_tokens for r in requests], max_input)
    outputs = scale([r.output_tokens for r in requests], max_output)
    return [Request(i, o) for i, o in zip(inputs, outputs, strict=True)]


PAD, BOS, EOS = 0, 1, 2
SPECIALS = ("<pad>", "<s>", "</s>")
MODEL_SEED = 0
# Bump when what is written changes, so a cached checkpoint of an older layout is not reused.
LAYOUT = 1

SHAPES = {
    # As tests/fixtures.py's tiny Llama: 2 layers, hidden 64, grouped-query attention; large weights give peaked
    # logits, as there. Positions for the whole mix (1,500 + 800 tokens) unscaled.
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.2,
    ),
    # meta-llama/Llama-3.1-8B's config.json: its shape, RoPE and norms (the tokenizer is ours, same vocab size).
    "llama-3.1-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}


def word(token: int) -> str:
    return SPECIALS[token] if token < len(SPECIALS) else f"w{token}"


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word(i): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS[PAD]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=SPECIALS[PAD],
        bos_token=SPECIALS[BOS],
        eos_token=SPECIALS[EOS],
        model_max_length=SHAPES["llama-3.1-8b"]["max_position_embeddings"],
    )
    fast.save_pretrained(folder)


def build(folder: Path, shape: str, device: str, dtype: str) -> Path:
    """Writes the checkpoint of `shape` into `folder` (safetensors, `dtype`), its weights drawn on `device`; a
    folder already complete (same shape, dtype and layout) is reused: an 8B checkpoint takes minutes to write."""
    marker = folder / "kettle_serving_model.json"
    stamp = {"shape": shape, "dtype": dtype, "seed": MODEL_SEED, "layout": LAYOUT}
    if marker.exists() and json.loads(marker.read_text()) == stamp:
        return folder
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder, SHAPES[shape]["vocab_size"])
    config = LlamaConfig(
        **SHAPES[shape], bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False
    )
    torch.manual_seed(MODEL_SEED)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        model.lm_head.weight[EOS].zero_()
    model.save_pretrained(folder, safe_serialization=True)
    GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD).save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the server about to start sizes its KV cache from the GPU's free memory
    marker.write_text(json.dumps(stamp))
    return folder


def prompt_ids(key: str, tokens: int, vocab_size: int) -> list[int]:
    """The prompt of the request named `key` (its workload and index): `tokens` ordinary words drawn from a
    generator seeded by the key, so every request has a prompt of its own (no prefix-cache hit between requests
    or between workloads) and every run the same ones."""
    rng = random.Random(key)
    return [rng.randrange(len(SPECIALS), vocab_size) for _ in range(tokens)]


def prompt_text(ids: list[int]) -> str:
    return " ".join(word(i) for i in ids)


# transformers' default share of the mix: 4 batches of 64 on a GPU run in minutes (8B, bf16), the whole mix in
# about as many again as the rest of the run; `--floor-requests 1000` asks for it.
FLOOR_REQUESTS = 256
KV_FREE = re.compile(r"^kettle_kv_blocks_free ([0-9.e+-]+)$", re.MULTILINE)
KV_TOTAL = re.compile(r"^kettle_kv_blocks_total ([0-9.e+-]+)$", re.MULTILINE)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench serving", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", choices=sorted(SHAPES), default="llama-3.1-8b", help="the random model's shape")
    p.add_argument("--device", choices=["cpu", "cuda"], help="where both engines run (default: cuda if present)")
    p.add_argument("--quantize", choices=["fp8", "int8", "int4"], help="the server's weights (transformers: dtype)")
    p.add_argument("--concurrency", default="1,16,64,256", help="closed-loop clients per row, comma-separated")
    p.add_argument("--per-client", type=int, default=4, help="requests per client in a concurrency row")
    p.add_argument("--requests", type=int, help="cap on every workload's requests (default: none; offline 1,000)")
    p.add_argument("--offline", action=argparse.BooleanOptionalAction, default=True, help="the all-at-once row")
    p.add_argument("--max-input", type=int, help="scale the mix's inputs so the longest is this many tokens")
    p.add_argument("--max-output", type=int, help="scale the mix's outputs so the longest is this many tokens")
    p.add_argument("--engines", default="kettle,transformers", help="kettle and/or transformers, comma-separated")
    p.add_argument(
        "--floor-requests", type=int, help="transformers' requests (default: the offline row's, at most 256)"
    )
    p.add_argument("--floor-batch", type=int, help="transformers' batch size (default: 64 on CUDA, 4 on the CPU)")
    p.add_argument("--kv-tokens", type=int, help="cap on the server's KV cache (default: CUDA none, CPU 65536)")
    p.add_argument("--sample-every", type=float, default=0.05, help="seconds between /metrics samples")
    p.add_argument("--checkpoint", type=Path, help="folder of the random checkpoint (default: in KETTLE_CACHE)")
    p.add_argument("--server-args", default="", help="extra `kettle launch` flags")
    p.add_argument("--json", type=Path, help="write the rows and the short answers here")
    return p


@dataclass
class Row:
    """One workload's figures (latencies in seconds, KV use as a fraction of the pool's blocks)."""

    engine: str
    workload: str
    requests: int
    concurrency: int
    output_tokens: int
    wall: float
    output_tok_s: float
    requests_s: float
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    itl_p50: float | None = None
    itl_p99: float | None = None
    kv_peak: float | None = None
    kv_mean: float | None = None
    kv_samples: int = 0
    short: list[dict] = field(default_factory=list)


# ---- Kettle over HTTP ----------------------------------------------------------------------------------------


def kv_used(text: str) -> float:
    """The fraction of the KV pool's blocks held by requests, from a /metrics page (cached prefix blocks that
    no request holds count as free, as the allocator counts them)."""
    free, total = float(KV_FREE.search(text).group(1)), float(KV_TOTAL.search(text).group(1))
    return 1 - free / total if total else 0.0


async def sample_kv(client, url: str, every: float, into: list[float]) -> None:
    while True:
        async with client.get(f"{url}/metrics") as response:
            into.append(kv_used(await response.text()))
        await asyncio.sleep(every)


async def run_workload(
    url: str, requests: list[Request], concurrency: int, tag: str, vocab: int, every: float
) -> tuple[LoadResult, list[float], list[dict]]:
    """`concurrency` clients in a closed loop over `requests`; the streams, the KV samples and the requests that
    failed, came out short or had their prompt counted differently."""
    prompts = [prompt_text(prompt_ids(f"{tag}:{i}", r.input_tokens, vocab)) for i, r in enumerate(requests)]
    todo = iter(range(len(requests)))
    streams: list[StreamTiming] = [StreamTiming(0.0) for _ in requests]
    samples: list[float] = []
    wrong: list[dict] = []

    async def client_loop(client) -> None:
        for i in todo:  # one iterator shared by every client: each takes the next request
            want = requests[i]
            streams[i] = StreamTiming(time.perf_counter())
            try:
                await stream_tokens(client, url, prompts[i], want.output_tokens, streams[i])
                error = None
            except Exception as e:  # a failed request is reported with the short ones; the run goes on
                error = f"{type(e).__name__}: {e}"
            got = len(streams[i].arrivals)
            if error or got != want.output_tokens or streams[i].prompt_tokens != want.input_tokens:
                wrong.append({**asdict(want), "got_output": got, "got_input": streams[i].prompt_tokens})
                wrong[-1] |= {"index": i, "error": error} if error else {"index": i}

    async with session() as client:
        sampler = asyncio.create_task(sample_kv(client, url, every, samples))
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(min(concurrency, len(requests)))))
        wall = time.perf_counter() - start
        sampler.cancel()
    answered = [s for s in streams if s.arrivals]
    return LoadResult(concurrency, wall, answered), samples, wrong


def kettle_row(workload: str, result: LoadResult, requests: int, samples: list[float], short: list[dict]) -> Row:
    s = result.summary() if result.streams else {}
    return Row(
        engine="kettle",
        workload=workload,
        requests=requests,
        concurrency=result.concurrency,
        output_tokens=result.tokens,
        wall=result.wall,
        output_tok_s=result.tokens_per_s,
        requests_s=requests / result.wall,
        ttft_p50=s.get("ttft p50"),
        ttft_p99=s.get("ttft p99"),
        itl_p50=s.get("itl p50"),
        itl_p99=s.get("itl p99"),
        kv_peak=max(samples, default=None),
        kv_mean=sum(samples) / len(samples) if samples else None,
        kv_samples=len(samples),
        short=short,
    )


def workloads(args: argparse.Namespace, mix: list[Request]) -> list[tuple[str, int, list[Request]]]:
    """(name, concurrency, requests) of each row: the concurrency rows, then offline."""
    cap = args.requests or len(mix)
    rows = [(f"c={c}", c, mix[: min(args.per_client * c, cap)]) for c in args.concurrency]
    if args.offline:
        rows.append(("offline", min(cap, len(mix)), mix[:cap]))
    return rows


def kettle_rows(args: argparse.Namespace, folder: Path, mix: list[Request]) -> list[Row]:
    plan = workloads(args, mix)
    longest_in, longest_out = max(r.input_tokens for r in mix), max(r.output_tokens for r in mix)
    flags = ["--max-input-tokens", str(longest_in), "--max-total-tokens", str(longest_in + longest_out)]
    flags += ["--max-concurrent-requests", str(max(len(reqs) for _, _, reqs in plan) + 8)]
    flags += ["--dtype", dtype_of(args.device)] + (["--quantize", args.quantize] if args.quantize else [])
    env = {"CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else {}
    kv_tokens = args.kv_tokens or (65536 if args.device == "cpu" else None)
    server = KettleServer(
        str(folder), *flags, *args.server_args.split(), env=env, timeout=1800, max_kv_tokens=kv_tokens
    )
    vocab = SHAPES[args.model]["vocab_size"]
    rows = []
    try:
        warm = [Request(min(32, longest_in), 8)] * 2  # the server's first-call paths, kept out of every row
        asyncio.run(run_workload(server.url, warm, 2, "warm-up", vocab, args.sample_every))
        for name, concurrency, requests in plan:
            result, samples, short = asyncio.run(
                run_workload(server.url, requests, concurrency, name, vocab, args.sample_every)
            )
            rows.append(kettle_row(name, result, len(requests), samples, short))
            print(table_line(rows[-1]), flush=True)
    finally:
        code = server.stop()
    if code != 0:
        raise RuntimeError(f"the server exited with {code}:\n{server.logs()}")
    return rows


# ---- the floor: transformers' batched generate -----------------------------------------------------------------


def transformers_row(args: argparse.Namespace, folder: Path, mix: list[Request]) -> Row:
    import torch
    from transformers import AutoModelForCausalLM

    count = args.floor_requests or min(args.requests or len(mix), len(mix), FLOOR_REQUESTS)
    batch = args.floor_batch or (64 if args.device == "cuda" else 4)
    requests = mix[:count]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype_of(args.device)))
    model = model.to(args.device).eval()
    vocab = SHAPES[args.model]["vocab_size"]

    def generate(chunk: list[Request], tag: str) -> int:
        """One left-padded greedy batch run to its longest answer; the tokens its rows generated, counted."""
        rows = [prompt_ids(f"{tag}:{i}", r.input_tokens, vocab) for i, r in enumerate(chunk)]
        width, steps = max(map(len, rows)), max(r.output_tokens for r in chunk)
        ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows], device=args.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=args.device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=steps,
                min_new_tokens=steps,
                pad_token_id=PAD,
                eos_token_id=EOS,
            )
        return out.shape[1] - width

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    # A first batch of the timed shape, a few steps long: transformers' first calls in a process are many times
    # slower than the next ones (measured: 6 s, then 1.3 s, then 0.07 s for the same tiny batch on the CPU).
    for _ in range(2):
        generate([Request(r.input_tokens, min(4, r.output_tokens)) for r in requests[:batch]], "floor-warm-up")
    short = []
    sync()
    start = time.perf_counter()
    for at in range(0, len(requests), batch):
        chunk = requests[at : at + batch]
        ran = generate(chunk, f"floor:{at}")
        short += [{**asdict(r), "index": at + i} for i, r in enumerate(chunk) if ran < r.output_tokens]
    sync()
    wall = time.perf_counter() - start
    tokens = sum(r.output_tokens for r in requests)
    workload = f"offline, batches of {batch}"
    return Row("transformers", workload, len(requests), batch, tokens, wall, tokens / wall, count / wall, short=short)


# ---- the report ---------------------------------------------------------------------------------------------

HEADER = (
    "| engine | workload | requests | output tok/s | req/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
    "| KV peak | KV mean |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def table_line(row: Row) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.1f}"

    def frac(x: float | None) -> str:
        return "-" if x is None else f"{x:.4f}"

    return (
        f"| {row.engine} | {row.workload} | {row.requests} | {row.output_tok_s:.1f} | {row.requests_s:.2f} | "
        f"{ms(row.ttft_p50)} | {ms(row.ttft_p99)} | {ms(row.itl_p50)} | {ms(row.itl_p99)} | "
        f"{frac(row.kv_peak)} | {frac(row.kv_mean)} |"
    )


def raise_open_files(want: int = 65536) -> None:
    """The offline row holds 1,000 connections open at once, in this process and in the router (which inherits the
    limit): the common default of 1,024 descriptors would leave little to spare, so the soft limit goes up to the
    hard one."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def dtype_of(device: str) -> str:
    return "bfloat16" if device == "cuda" else "float32"


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def serving(argv: list[str]) -> None:
    import torch

    from kettle import settings

    args = parser().parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    engines = set(args.engines.split(","))
    if not engines <= {"kettle", "transformers"}:
        raise SystemExit(f"--engines: kettle and/or transformers, not {args.engines!r}")
    raise_open_files()
    dtype = dtype_of(args.device)
    folder = args.checkpoint or settings.current().cache_dir / "bench" / f"serving-{args.model}-{dtype}"
    start = time.perf_counter()
    build(folder, args.model, args.device, dtype)
    mix = scaled(load(), args.max_input, args.max_output)
    print(
        f"{device_name(args.device)}: {args.model} ({dtype}) in {folder}, ready in {time.perf_counter() - start:.0f}s"
    )
    print(HEADER, flush=True)
    rows = kettle_rows(args, folder, mix) if "kettle" in engines else []
    if "transformers" in engines:
        rows.append(transformers_row(args, folder, mix))
        print(table_line(rows[-1]), flush=True)
    report(args, rows)


def report(args: argparse.Namespace, rows: list[Row]) -> None:
    print("\n" + HEADER)
    print("\n".join(table_line(row) for row in rows))
    engines = {row.engine: row for row in rows if row.workload.startswith("offline")}
    if {"kettle", "transformers"} <= set(engines):
        ratio = engines["kettle"].output_tok_s / engines["transformers"].output_tok_s
        print(f"\nkettle offline / transformers, output tok/s: {ratio:.2f}x")
    short = [(row.workload, s) for row in rows for s in row.short]
    print(f"\nanswers not of their requested length (or failed): {len(short)}")
    for workload, s in short:
        print(f"  {workload}: {s}")
    if args.json:
        body = {"device": device_name(args.device), "model": args.model, "quantize": args.quantize}
        body |= {"args": {k: str(v) for k, v in vars(args).items()}, "rows": [asdict(row) for row in rows]}
        args.json.write_text(json.dumps(body, indent=2))


if __name__ == "__main__":
    PATH.parent.mkdir(exist_ok=True)
    PATH.write_text(document(generate()))
    print(f"wrote {len(load())} pairs to {PATH}")
