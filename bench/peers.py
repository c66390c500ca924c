"""Kettle against the engines a user would pick instead, on the same model, prompts and greedy settings, in one run.

    make bench                  # Kettle and transformers at 1, 4, 8, 16 streams, each engine's default threads
    make bench-peers            # installs ctranslate2 + llama-cpp-python into .venv, then every engine
    .venv/bin/python -m bench peers --threads 2 --engines ctranslate2,llama.cpp,kettle --rounds 5
    .venv/bin/python -m bench peers --max-new-tokens 32 --streams 1 --threads 1       # a quick check

Engines: transformers `generate` (fp32; 16 streams = one left-padded batch of 16), CTranslate2 int8 (the bundled
model converted once with its transformers converter), llama.cpp through llama-cpp-python on the bundled GGUF
(batch 1 only: its Python API decodes one sequence), and Kettle over HTTP as `make serve` runs it (`kettle`), and
with `--quantize int4` and `int8`. Each peer runs in its own subprocess at each `--threads` count (`default`:
each engine's own choice, Kettle's physical cores); the table keeps each engine's fastest. An engine whose
package is missing is skipped with a line saying so. Prompts are kettle.bench.loadgen's, rendered with the chat
template; stream i gets prompt i. decode tok/s is measured the way loadgen does for every engine: the tokens
after each stream's first, over the time from the first first-token to the last token. With `--rounds N` every
engine is measured N times, the engines' order reversed every other round (so drift on a shared machine hits
them alike): the table shows each configuration's median, and each round's ratios of Kettle to every peer at the
same streams are printed with their median.

`--shape NAME` compares Kettle with llama.cpp on a model the size people run instead: a GGUF of a real model's
shape with random weights (speed does not depend on the values), written once to ~/.cache/kettle/bench/ with the
bundled tokenizer, timed in this process round by round: decode (greedy steps after a 16-token prompt) and a
`--prompt`-token prefill, each engine on the largest `--threads`. Each round first measures the machine's read
bandwidth (`read_bandwidth`): the table gives decode as a share of it, round by round, and prefill in GOP/s
(`prefill_ops`):

    .venv/bin/python -m bench peers --shape smollm2-1.7b --qtype Q4_K_M --rounds 3
    .venv/bin/python -m bench peers --shape llama-3.1-8b --qtype Q4_K_M --rounds 3

With llama-cpp-python installed the file is the one a user downloads: a float16 file of the shape (kept beside,
`<shape>-F16.gguf`) quantized by llama.cpp's own quantizer into `--qtype`, with its mix rules (Q4_K_M's Q6_K
`attn_v`/`ffn_down` in some layers and Q6_K head, a tied head as the real model has). Without it, random but well
formed blocks written by gguf-py in the same layouts (`--untied`: an embedding in --qtype and a Q8_0 head).

The table's header says which instructions each engine ran. To measure both as on a CPU without AVX-512 on one
that has it: Kettle's `KETTLE_TUNING=cpu-isa=avx2` (or `avx-vnni`), torch's own ops held to AVX2 by its variables,
and a llama-cpp-python built without AVX-512, found first on `PYTHONPATH`:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF" \
        .venv/bin/pip install --no-cache-dir --no-deps --target ~/.cache/kettle/llama-avx2 llama-cpp-python
    PYTHONPATH=~/.cache/kettle/llama-avx2 KETTLE_TUNING=cpu-isa=avx2 ATEN_CPU_CAPABILITY=avx2 \
        ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python -m bench peers --shape smollm2-1.7b --qtype Q4_K_M --rounds 3
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kettle.bench.loadgen import chat_prompts
from kettle.bench.timing import ratio_summary

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
PEER_PACKAGES = {"transformers": "transformers", "ctranslate2": "ctranslate2", "llama.cpp": "llama_cpp"}
# llama-cpp-python's high-level API decodes one sequence at a time, so it gets no batched row.
SINGLE_STREAM_ONLY = {"llama.cpp"}
ENGINES = ("transformers", "ctranslate2", "llama.cpp", "kettle", "kettle-int4", "kettle-int8")
LABELS = {
    "transformers": "transformers generate (fp32)",
    "ctranslate2": "CTranslate2 (int8)",
    "llama.cpp": "llama.cpp (GGUF Q4_1)",
    "kettle": "kettle",
    "kettle-int4": "kettle --quantize int4",
    "kettle-int8": "kettle --quantize int8",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench peers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, from {', '.join(ENGINES)}")
    p.add_argument("--streams", default="1,16", help="concurrent streams (a batch for the peers)")
    p.add_argument(
        "--threads", default="1,2", help="thread counts tried per engine, the fastest shown; `default`: the engines'"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1, help="measure every engine this many times; medians")
    p.add_argument("--shape", choices=sorted(SHAPES), help="Kettle against llama.cpp on a GGUF of this shape")
    qtypes = ["Q4_0", "Q4_K", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS"]
    p.add_argument("--qtype", choices=qtypes, default="Q4_0", help="with --shape")
    p.add_argument("--untied", action="store_true", help="with --shape: an embedding in --qtype, a Q8_0 head")
    p.add_argument("--tokens", type=int, default=64, help="with --shape: decode steps timed per round")
    p.add_argument("--prompt", type=int, default=512, help="with --shape: prefill prompt length")
    p.add_argument("--served", action="store_true", help="with --shape: Kettle served (HTTP) as a user runs it")
    p.add_argument("--worker", choices=list(PEER_PACKAGES), help=argparse.SUPPRESS)
    p.add_argument("--worker-streams", type=int, default=1, help=argparse.SUPPRESS)
    return p


def peers(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    threads = [None] if args.threads == "default" else [int(x) for x in args.threads.split(",")]
    if args.worker:
        return run_worker(args, threads[0])
    if args.shape:
        run = served_model if args.served else larger_model
        return run(args, max(t or os.cpu_count() for t in threads))
    engines = args.engines.split(",")
    unknown = set(engines) - set(ENGINES)
    if unknown:
        parser().error(f"unknown engine(s) {', '.join(sorted(unknown))}; choose from {', '.join(ENGINES)}")
    for engine in [e for e in engines if not e.startswith("kettle")]:
        if importlib.util.find_spec(PEER_PACKAGES[engine]) is None:
            print(f"skipped {engine}: `{PEER_PACKAGES[engine]}` is not installed (`make bench-peers` installs it)")
            engines.remove(engine)
    streams = [int(x) for x in args.streams.split(",")]
    rounds = []
    for i in range(args.rounds):
        print(f"round {i + 1} of {args.rounds}", file=sys.stderr)
        order = engines[:: -1 if i % 2 else 1]
        rounds.append([row for e in order for row in measure_engine(e, threads, streams, args.max_new_tokens)])
    print_table(fastest(medians(rounds)), args.max_new_tokens)
    print()
    print_ratios(rounds)


@dataclass(frozen=True)
class Row:
    """One measured configuration: an engine at a thread count (None: its default) and a number of streams; Kettle's
    rows also carry the streams' median time to first token and inter-token latency (seconds)."""

    engine: str
    threads: int | None
    streams: int
    decode: float
    ttft: float | None = None
    itl: float | None = None


def decode_rate(arrivals: list[list[float]]) -> float:
    """Tokens after each stream's first, over first first-token to last token (as loadgen.LoadResult does)."""
    decoded = sum(len(a) - 1 for a in arrivals)
    span = max(a[-1] for a in arrivals) - min(a[0] for a in arrivals)
    return decoded / span if span > 0 else float("nan")


# ---- workers: each runs in its own subprocess, prints one JSON line with its decode rate --------------------


def transformers_worker(model_path: str, prompts: list[str], max_new_tokens: int) -> list[list[float]]:
    """One left-padded batch through fp32 greedy `generate`; a streamer timestamps every step."""
    import torch
    from transformers import AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    from kettle.bench.drive import transformers_model

    class StepClock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.prompt_seen = False

        def put(self, value) -> None:  # the first call carries the prompt, every later one a step's tokens
            if self.prompt_seen:
                self.times.append(time.perf_counter())
            self.prompt_seen = True

        def end(self) -> None:
            pass

    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    model = transformers_model(model_path, torch.float32)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    clock = StepClock()
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, streamer=clock)
    rows = out[:, batch.input_ids.shape[1] :].tolist()
    # A finished row is padded while others go on; it counts its tokens up to and including its EOS.
    lengths = [next((i + 1 for i, t in enumerate(row) if t in eos), len(row)) for row in rows]
    return [clock.times[:n] for n in lengths]


def ctranslate2_worker(model_path: str, prompts: list[str], max_new_tokens: int, threads: int | None) -> list[list]:
    """One int8 `generate_batch` (greedy); its per-token callback timestamps each stream's tokens."""
    import ctranslate2
    from transformers import AutoTokenizer

    generator = ctranslate2.Generator(
        str(ct2_model(model_path)), device="cpu", compute_type="int8", intra_threads=threads or 0, inter_threads=1
    )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokens = [tokenizer.convert_ids_to_tokens(tokenizer(p).input_ids) for p in prompts]
    arrivals: list[list[float]] = [[] for _ in prompts]
    generator.generate_batch(
        tokens,
        max_length=max_new_tokens,
        sampling_topk=1,
        beam_size=1,
        include_prompt_in_result=False,
        callback=lambda step: record(arrivals[step.batch_id]),
    )
    return arrivals


def record(arrivals: list[float]) -> bool:
    """Timestamps a token; False tells CTranslate2 to go on decoding."""
    arrivals.append(time.perf_counter())
    return False


def ct2_model(model_path: str) -> Path:
    """The bundled model converted to CTranslate2 int8, once, under the Kettle cache (reused by later runs)."""
    from ctranslate2.converters import TransformersConverter

    from kettle.hub.cache import build_once, cache_root
    from kettle.hub.gguf import GGUF_LINK
    from kettle.hub.resolve import float_folder

    # A GGUF folder's name ends with its file's key, so the conversion records that file: once it is gone (a
    # deleted virtual environment's bundled model), the next conversion here removes this one.
    link = Path(model_path) / GGUF_LINK
    sources = [link.resolve()] if link.exists() else []
    target = cache_root() / "peers" / f"ct2-int8-{Path(model_path).name}"
    converter = TransformersConverter(str(float_folder(model_path)))

    def convert(out: Path) -> None:
        converter.convert(str(out), quantization="int8", force=True)

    return build_once(target, convert, "CTranslate2 int8", sources)


def llama_cpp_worker(prompts: list[str], max_new_tokens: int, threads: int | None) -> list[list[float]]:
    """Greedy llama.cpp on the bundled GGUF, the one prompt of a single stream."""
    from llama_cpp import Llama

    from kettle.hub.resolve import bundled_gguf

    llm = Llama(model_path=str(bundled_gguf()), n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False)
    (prompt,) = prompts
    ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    arrivals: list[float] = []
    for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        arrivals.append(time.perf_counter())
        if token == llm.token_eos() or len(arrivals) >= max_new_tokens:
            break
    return [arrivals]


def run_worker(args: argparse.Namespace, threads: int | None) -> None:
    """Child side: a short warm-up call, then the timed one; prints {"decode": tok/s}."""
    if args.worker == "transformers" and threads:
        import torch

        torch.set_num_threads(threads)
    model_path = bundled_model_path()
    rendered = chat_prompts(model_path)
    prompts = [rendered[i % len(rendered)] for i in range(args.worker_streams)]  # as loadgen.run_load
    workers = {
        "transformers": lambda n: transformers_worker(model_path, prompts, n),
        "ctranslate2": lambda n: ctranslate2_worker(model_path, prompts, n, threads),
        "llama.cpp": lambda n: llama_cpp_worker(prompts, n, threads),
    }
    workers[args.worker](4)
    print(json.dumps({"decode": decode_rate(workers[args.worker](args.max_new_tokens))}))


# ---- parent: spawns the peers and Kettle servers, prints the table -------------------------------------------


def bundled_model_path() -> str:
    from kettle.hub.resolve import resolve_model

    return str(resolve_model(None).path)


def measure_engine(engine: str, threads: list[int | None], streams: list[int], max_new_tokens: int) -> list[Row]:
    """One engine's rows: Kettle through its server (with `--quantize` for the kettle-int4/int8 entries), a peer
    through its workers."""
    if engine.startswith("kettle"):
        flags = ["--quantize", engine.removeprefix("kettle-")] if engine != "kettle" else []
        return kettle_rows(engine, flags, threads, streams, max_new_tokens)
    return peer_rows(engine, threads, streams, max_new_tokens)


def peer_rows(engine: str, threads: list[int | None], streams: list[int], max_new_tokens: int) -> list[Row]:
    """One subprocess per (threads, streams); OMP_NUM_THREADS pins the libraries' own pools too."""
    rows = []
    for t in threads:
        for s in [s for s in streams if s == 1 or engine not in SINGLE_STREAM_ONLY]:
            argv = [sys.executable, "-m", "bench", "peers", "--worker", engine, "--worker-streams", str(s)]
            argv += ["--threads", str(t or "default"), "--max-new-tokens", str(max_new_tokens)]
            env = {**os.environ, **({"OMP_NUM_THREADS": str(t)} if t else {})}
            done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
            if done.returncode != 0:
                print(f"{engine} threads={t} streams={s} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            rows.append(Row(engine, t, s, json.loads(done.stdout.strip().splitlines()[-1])["decode"]))
            print(f"  {engine} threads={t or 'default'} streams={s}: {rows[-1].decode:.1f} tok/s", file=sys.stderr)
    return rows


def kettle_rows(
    name: str, flags: list[str], threads: list[int | None], streams: list[int], max_new_tokens: int
) -> list[Row]:
    """One launcher per thread count (`--num-threads`; none for `default`), measured with loadgen at each
    concurrency."""
    from kettle.bench.loadgen import measure
    from kettle.bench.process import KettleServer

    model_path = bundled_model_path()
    prompts = chat_prompts(model_path)
    rows = []
    for t in threads:
        count = ["--num-threads", str(t)] if t else []
        server = KettleServer(model_path, "--max-concurrent-requests", "256", *count, *flags)
        try:
            results = measure(server.url, prompts, streams, max_new_tokens)
        finally:
            server.stop()
        for s, result in results.items():
            summary = result.summary()
            rows.append(Row(name, t, s, result.decode_tokens_per_s, summary["ttft p50"], summary["itl p50"]))
            print(f"  {name} threads={t or 'default'} streams={s}: {rows[-1].decode:.1f} tok/s", file=sys.stderr)
    return rows


def fastest(rows: list[Row]) -> list[Row]:
    """Each (engine, streams) at its fastest thread count, in first-seen order."""
    best: dict[tuple[str, int], Row] = {}
    for row in rows:
        key = (row.engine, row.streams)
        if key not in best or row.decode > best[key].decode:
            best[key] = row
    return list(best.values())


def medians(rounds: list[list[Row]]) -> list[Row]:
    """Each (engine, threads, streams) at its median over the rounds, in first-seen order."""
    runs: dict[tuple[str, int | None, int], list[Row]] = {}
    for row in (row for rows in rounds for row in rows):
        runs.setdefault((row.engine, row.threads, row.streams), []).append(row)
    out = []
    for key, rows in runs.items():
        ttft = [r.ttft for r in rows if r.ttft is not None]
        itl = [r.itl for r in rows if r.itl is not None]
        median = statistics.median
        out.append(
            Row(*key, median(r.decode for r in rows), median(ttft) if ttft else None, median(itl) if itl else None)
        )
    return out


def print_ratios(rounds: list[list[Row]]) -> None:
    """Per round, each Kettle configuration over each peer at the same streams (fastest thread counts), and
    Kettle's most streams over its single stream."""
    best = [{(r.engine, r.streams): r.decode for r in fastest(rows)} for rows in rounds]
    keys = list(dict.fromkeys(key for b in best for key in b))
    for engine, streams in [k for k in keys if k[0].startswith("kettle")]:
        for peer in [e for e, s in keys if s == streams and not e.startswith("kettle")]:
            ratios = [
                b[engine, streams] / b[peer, streams] for b in best if (engine, streams) in b and (peer, streams) in b
            ]
            if ratios:
                print(f"{LABELS[engine]} / {LABELS[peer]} at {streams} stream(s): {ratio_summary(ratios)}")
    counts = sorted({s for e, s in keys if e == "kettle"})
    if len(counts) > 1 and counts[0] == 1:
        ratios = [
            b["kettle", counts[-1]] / b["kettle", 1] for b in best if ("kettle", 1) in b and ("kettle", counts[-1]) in b
        ]
        print(f"kettle {counts[-1]} streams / kettle 1 stream: {ratio_summary(ratios)}")


def print_table(rows: list[Row], max_new_tokens: int) -> None:
    baseline = next((r.decode for r in rows if r.engine == "transformers" and r.streams == 1), None)
    print(f"\nmodel: {bundled_model_path()}\nmax_new_tokens={max_new_tokens}, greedy, chat-templated prompts\n")
    print("| engine | threads | streams | decode tok/s | TTFT p50 ms | ITL p50 ms | vs transformers b=1 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r.decode / baseline:.2f}x" if baseline else "-"
        ttft = f"{r.ttft * 1e3:.1f}" if r.ttft is not None else "-"
        itl = f"{r.itl * 1e3:.1f}" if r.itl is not None else "-"
        threads = r.threads or "default"
        print(f"| {LABELS[r.engine]} | {threads} | {r.streams} | {r.decode:.1f} | {ttft} | {itl} | {ratio} |")


# ---- --shape: a model the size people run, against llama.cpp in this process ---------------------------------

# hidden, layers, heads, KV heads, intermediate (the vocabulary is the bundled tokenizer's)
SHAPES = {
    "tinyllama-1.1b": (2048, 22, 32, 4, 5632),
    "llama-3.2-1b": (2048, 16, 32, 8, 8192),
    "smollm2-360m": (960, 32, 15, 5, 2560),
    "smollm2-1.7b": (2048, 24, 32, 32, 8192),
    "llama-3.2-3b": (3072, 28, 24, 8, 8192),
    "llama-3.1-8b": (4096, 32, 32, 8, 14336),
}
# Whether the real model ties its head to the embedding (the files llama.cpp's quantizer writes follow it).
TIED = {"tinyllama-1.1b": False, "llama-3.2-1b": True, "smollm2-360m": True, "smollm2-1.7b": True,
        "llama-3.2-3b": True, "llama-3.1-8b": False}  # fmt: skip
SETTLE_S = 1.0  # the other engine's idle threads (OpenMP's, llama.cpp's pool) spin a while after their last work
READ_PROBE_BYTES = 1 << 30  # what `read_bandwidth` sums: many times a last-level cache, so it comes from memory


def larger_model(args: argparse.Namespace, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    folder = write_model(args.shape, args.qtype, args.untied)
    engines = {"kettle": KettleRunner(folder), "llama.cpp": LlamaCppRunner(folder, threads)}
    results = {name: {"decode": [], "prefill": []} for name in engines}
    probe, read = torch.ones(READ_PROBE_BYTES // 8, dtype=torch.int64), []
    for round_ in range(args.rounds):
        time.sleep(SETTLE_S)
        read.append(read_bandwidth(probe))
        for name in list(engines) if round_ % 2 == 0 else list(engines)[::-1]:
            for kind, size in (("decode", args.tokens), ("prefill", args.prompt)):
                time.sleep(SETTLE_S)
                results[name][kind].append(getattr(engines[name], kind)(size))
        line = (f"{n} decode {r['decode'][-1]:.1f}, prefill {r['prefill'][-1]:.1f} tok/s" for n, r in results.items())
        print(f"round {round_ + 1}: read {read[-1] / 1e9:.1f} GB/s, " + ", ".join(line), flush=True)
    del probe
    sizes = {"kettle": engines["kettle"].weight_bytes(), "llama.cpp": file_step_bytes(folder / "model.gguf")}
    ops = prefill_ops(SHAPES[args.shape], args.prompt)
    print(f"\n{args.shape} {args.qtype}, {threads} threads, medians of {args.rounds} rounds")
    print(f"instructions: Kettle's kernels {kettle_isa()}, llama.cpp {llama_cpp_isa()}")
    each, gib = ", ".join(f"{r / 1e9:.1f}" for r in read), READ_PROBE_BYTES >> 30
    print(f"read bandwidth ({threads} threads, a {gib} GiB sum): {statistics.median(read) / 1e9:.1f} GB/s ({each})")
    print("| engine | decode tok/s | GB/s (weights a step) | of the read bandwidth | prefill tok/s | prefill GOP/s |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        decode, prefill = statistics.median(r["decode"]), statistics.median(r["prefill"])
        share = statistics.median(d * sizes[name] / b for d, b in zip(r["decode"], read, strict=True))
        print(f"| {name} | {decode:.1f} | {decode * sizes[name] / 1e9:.1f} ({sizes[name] / 2**20:.0f} MiB) "
              f"| {100 * share:.0f}% | {prefill:.1f} | {prefill / args.prompt * ops / 1e9:.0f} |")  # fmt: skip
    for kind in ("decode", "prefill"):
        ratios = [a / b for a, b in zip(results["kettle"][kind], results["llama.cpp"][kind], strict=True)]
        print(f"Kettle / llama.cpp, {kind}: {ratio_summary(ratios)}")


def kettle_isa() -> str:
    """What Kettle's kernels run in this process (`KETTLE_TUNING=cpu-isa` limits it)."""
    from kettle.kernels import build

    return build.instructions() or "none (PyTorch's ops)"


def llama_cpp_isa() -> str:
    """What the loaded llama.cpp build runs, from its system info (`AVX512_VNNI = 1` and the like)."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    for flag, name in (("AVX512_VNNI = 1", "AVX-512 VNNI"), ("AVX512 = 1", "AVX-512"), ("AVX_VNNI = 1", "AVX2 + VNNI")):
        if flag in info:
            return name
    return "AVX2" if "AVX2 = 1" in info else "neither AVX2 nor AVX-512"


def read_bandwidth(probe: torch.Tensor, passes: int = 3) -> float:
    """Bytes a second the machine reads now: the fastest of `passes` sums of `probe` (int64, so the pass is loads
    and adds) on torch's threads, which the caller set to the engines' count. Measured every round beside the
    engines: a shared host's bandwidth drifts by tens of percent within an hour. On this project's Zen 3 machine
    it reads as a hand-written AVX2 loop over the same GiB does."""
    fastest = float("inf")
    for _ in range(passes):
        started = time.perf_counter()
        probe.sum()
        fastest = min(fastest, time.perf_counter() - started)
    return probe.numel() * probe.element_size() / fastest


def prefill_ops(shape: tuple[int, int, int, int, int], prompt: int) -> float:
    """The operations (2 per multiply-add) of a `prompt`-token prefill of a `SHAPES` entry: every projection's
    weights once per token, and causal attention's scores and weighted values (each token with itself and those
    before it). The head runs for the last position only and is left out."""
    hidden, layers, heads, kv_heads, inner = shape
    dim = hidden // heads
    weights = layers * hidden * (2 * hidden + 2 * kv_heads * dim + 3 * inner)
    attention = layers * heads * dim * 2 * prompt * (prompt + 1) / 2
    return 2 * (weights * prompt + attention)


SERVED_COLUMNS = ("start s", "RSS MiB", "decode 1", "decode 4", "prefill 512", "prefill 2048")


def served_model(args: argparse.Namespace, threads: int) -> None:
    """`--served`: each round Kettle is started as a user starts it (`kettle launch --model-id <folder>`, no flags;
    the KV cache capped at 4,096 tokens, llama.cpp's context) and measured over HTTP (start until /health answers,
    the resident memory of its processes, decode tok/s of 1 and 4 streams, prefill tok/s of 512- and 2,048-token
    prompts as the time to a first token), then llama.cpp loads the same file in this process and is measured alike
    (its Python API decodes one sequence: no 4-stream column)."""
    folder = write_model(args.shape, args.qtype, args.untied)
    results: dict[str, list[dict[str, float]]] = {"kettle": [], "llama.cpp": []}
    for round_ in range(args.rounds):
        for name in ("kettle", "llama.cpp")[:: -1 if round_ % 2 else 1]:
            time.sleep(SETTLE_S)
            run = served_kettle if name == "kettle" else in_process_llama_cpp
            results[name].append(run(folder, threads, args.tokens, round_))
            print(f"round {round_ + 1} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    print(f"\n{args.shape} {args.qtype} (llama.cpp's file), {threads} threads, medians of {args.rounds} rounds")
    print("| engine | " + " | ".join(SERVED_COLUMNS) + " |")
    print("|---" * (len(SERVED_COLUMNS) + 1) + "|")
    for name, rounds in results.items():
        cells = [statistics.median(r[c] for r in rounds) if c in rounds[0] else None for c in SERVED_COLUMNS]
        print(f"| {name} | " + " | ".join("-" if v is None else f"{v:.1f}" for v in cells) + " |")
    for column in ("start s", "decode 1", "prefill 512", "prefill 2048"):
        ratios = [a[column] / b[column] for a, b in zip(results["kettle"], results["llama.cpp"], strict=True)]
        print(
            f"Kettle / llama.cpp, {column}: {ratio_summary(ratios)}"
            + (" (lower is better)" if column == "start s" else "")
        )


def served_kettle(folder: Path, threads: int, tokens: int, trial: int) -> dict[str, float]:
    import httpx
    import psutil

    from kettle.bench.loadgen import measure, prompt_of_tokens
    from kettle.bench.process import KettleServer

    started = time.perf_counter()
    server = KettleServer(str(folder), "--num-threads", str(threads), max_kv_tokens=4096, poll=0.05)
    row = {"start s": time.perf_counter() - started}
    try:
        loads = measure(server.url, chat_prompts(str(folder)), [1, 4], tokens)
        row |= {"decode 1": loads[1].decode_tokens_per_s, "decode 4": loads[4].decode_tokens_per_s}
        for size in (512, 2048):
            body = {"inputs": prompt_of_tokens(server.url, size, trial), "parameters": {"max_new_tokens": 1}}
            sent = time.perf_counter()
            httpx.post(f"{server.url}/generate", json=body, timeout=600).raise_for_status()
            row[f"prefill {size}"] = size / (time.perf_counter() - sent)
        launcher = psutil.Process(server.process.pid)  # after the longest prompt: its activations counted
        row["RSS MiB"] = sum(p.memory_info().rss for p in [launcher, *launcher.children(recursive=True)]) / 2**20
    finally:
        server.stop()
    return row


def in_process_llama_cpp(folder: Path, threads: int, tokens: int, trial: int) -> dict[str, float]:
    import psutil

    before = psutil.Process().memory_info().rss
    started = time.perf_counter()
    runner = LlamaCppRunner(folder, threads)
    row = {"start s": time.perf_counter() - started}
    runner.decode(4)  # its first-call paths, as Kettle's warm-up does
    row["decode 1"] = runner.decode(tokens)
    row |= {f"prefill {size}": runner.prefill(size) for size in (512, 2048)}
    row["RSS MiB"] = (psutil.Process().memory_info().rss - before) / 2**20  # what loading and running it added
    runner.llm.close()
    return row


class KettleRunner:
    """The shard's step over a served cache (16-bit K/V, as a CPU shard keeps them): greedy decode after a 16-token
    prompt, and a prefill of a whole prompt, the logits of its last position only."""

    def __init__(self, folder: Path) -> None:
        import torch

        from kettle.models.registry import load_model
        from kettle.process_memory import keep_start_objects

        self.model = load_model(str(folder), torch.float32, "cpu")
        # As a shard does once ready: without it each full collection walked torch's modules and the model, 2.5% of
        # a 1.7B Q4_K_M decode step here (perf), which a served step does not pay.
        keep_start_objects()

    def decode(self, tokens: int) -> float:
        from kettle.bench.drive import DecodeLoop

        loop = DecodeLoop(self.model, 1, 16, tokens)
        started = time.perf_counter()
        for _ in range(tokens):
            loop()
        return tokens / (time.perf_counter() - started)

    def prefill(self, prompt: int) -> float:
        import torch

        from kettle.bench.drive import PrefillLoop

        loop = PrefillLoop(self.model, torch.arange(100, 100 + prompt))
        started = time.perf_counter()
        loop()
        return prompt / (time.perf_counter() - started)

    def weight_bytes(self) -> int:
        """The bytes a decode step reads: every tensor but an embedding table of its own (a step looks up a few
        of its rows); a table tied to the head is read whole, as the head."""
        import torch

        model = self.model
        tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()] if not t.is_mkldnn}
        table = getattr(model.embed_rows, "__self__", None)
        dense = getattr(model, "embed_tokens", None)
        own = [] if table is None or table is model.lm_head else [*table.buffers()]
        skip = {t.data_ptr() for t in own + ([dense] if isinstance(dense, torch.Tensor) else [])}
        return sum(t.numel() * t.element_size() for p, t in tensors.items() if p not in skip)


class LlamaCppRunner:
    def __init__(self, folder: Path, threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(str(folder / "model.gguf"), n_ctx=4096, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, verbose=False)  # fmt: skip

    def decode(self, tokens: int) -> float:
        stamps = []
        for _ in self.llm.generate(list(range(100, 116)), top_k=1, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) > tokens:
                break
        return tokens / (stamps[-1] - stamps[0])

    def prefill(self, prompt: int) -> float:
        self.llm.reset()
        started = time.perf_counter()
        self.llm.eval(list(range(100, 100 + prompt)))
        return prompt / (time.perf_counter() - started)


def file_step_bytes(path: Path) -> int:
    """The bytes a llama.cpp step reads: the file's tensors, less an untied embedding table (a tied one is the head)."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    return sum(tensors.values()) - (tensors["token_embd.weight"] if "output.weight" in tensors else 0)


def write_model(shape: str, qtype_name: str, untied: bool = False) -> Path:
    """The GGUF and its Kettle folder for `shape` in `qtype_name` (written once: ~0.6-5 GB, minutes), with a
    config.json and the bundled model's tokenizer, so Kettle loads the folder as it loads any GGUF folder.

    With llama-cpp-python installed the file is what a user downloads: a float16 file of random weights quantized by
    llama.cpp's own `llama_model_quantize` into `qtype_name`, its mix rules and all (which tensors keep more bits, the
    head's type, tied or not as the real model is). Without it, random blocks in gguf-py's layouts as those mixes
    lay them out (the speed of a step does not depend on the values)."""
    import importlib.util

    from kettle.hub import resolve_model

    by_llama_cpp = importlib.util.find_spec("llama_cpp") is not None and not untied
    tied = TIED[shape] if by_llama_cpp else not (untied or qtype_name.endswith("_K_M"))
    cache = Path.home() / ".cache" / "kettle" / "bench"
    suffix = "" if by_llama_cpp else "-gguf-py" + ("-untied" if untied else "")
    folder = cache / f"{shape}-{qtype_name}{suffix}"
    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    source = resolve_model(None).path
    if by_llama_cpp:
        _quantize(_float16_file(shape, source, cache), folder / "model.gguf", qtype_name)
    else:
        _write_random_blocks(folder / "model.gguf", shape, qtype_name, source, tied)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(source / name, folder / name)
    hidden, layers, heads, kv_heads, inner = SHAPES[shape]
    config = json.loads((source / "config.json").read_text())
    config.update(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, head_dim=hidden // heads,
                  num_key_value_heads=kv_heads, intermediate_size=inner, max_position_embeddings=4096,
                  rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, rope_theta=10000.0,
                  tie_word_embeddings=tied)  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def _float16_file(shape: str, source: Path, cache: Path) -> Path:
    """`shape` in float16 with random weights (N(0, 0.02²), norms at 1), the input of llama.cpp's quantizer; written
    once per shape, tensor by tensor (an 8B file is 16 GB: never whole in memory)."""
    import gguf
    import numpy as np

    path = cache / f"{shape}-F16.gguf"
    if path.exists():
        return path
    hidden, layers = SHAPES[shape][:2]
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    tensors = [("token_embd.weight", (vocab, hidden))] + ([] if TIED[shape] else [("output.weight", (vocab, hidden))])
    tensors.append(("output_norm.weight", (hidden,)))
    for layer in range(layers):
        tensors += [(f"blk.{layer}.{name}.weight", dims) for name, dims in _layer_tensors(SHAPES[shape])]
    writer = gguf.GGUFWriter(cache / f"{shape}-F16.partial", "llama")
    _metadata(writer, gguf.GGUFReader(source / "model.gguf"), SHAPES[shape], "F16")
    for name, dims in tensors:
        dtype = np.float32 if len(dims) == 1 else np.float16  # llama.cpp keeps norms in float32
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for i, (_, dims) in enumerate(tensors):
        if len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, np.float32))
        else:
            writer.write_tensor_data((rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16))
        print(f"\rwrote {i + 1}/{len(tensors)} float16 tensors", end="", file=sys.stderr, flush=True)
    writer.close()
    print(file=sys.stderr)
    (cache / f"{shape}-F16.partial").rename(path)
    return path


def _quantize(source: Path, out: Path, qtype_name: str) -> None:
    """llama.cpp's own quantizer, as `llama-quantize source out TYPE` runs it, on every core."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{'Q4_K_S' if qtype_name == 'Q4_K' else qtype_name}")
    params.nthread = os.cpu_count() or 1
    started = time.perf_counter()
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {qtype_name}")
    took = time.perf_counter() - started
    print(f"llama.cpp quantized {source.name} to {qtype_name} in {took:.0f} s", file=sys.stderr)


def _layer_tensors(shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """A llama layer's tensors and their (rows, columns), norms first."""
    hidden, _, heads, kv_heads, inner = shape
    kv = kv_heads * (hidden // heads)
    norms = [("attn_norm", (hidden,)), ("ffn_norm", (hidden,))]
    return [*norms, ("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
            ("attn_output", (hidden, hidden)), ("ffn_gate", (inner, hidden)), ("ffn_up", (inner, hidden)),
            ("ffn_down", (hidden, inner))]  # fmt: skip


def _write_random_blocks(path: Path, shape: str, qtype_name: str, source: Path, tied: bool) -> None:
    """Random but well-formed blocks (gguf-py cannot quantize to the K types), laid out as llama.cpp's mixes do:
    a `_K_M` file untied, its head Q6_K, the `use_more_bits` layers' attn_v and ffn_down in Q6_K."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as T

    mix = qtype_name.endswith("_K_M")
    hidden, layers = SHAPES[shape][:2]
    writer = gguf.GGUFWriter(path, "llama")
    _metadata(writer, gguf.GGUFReader(source / "model.gguf"), SHAPES[shape], qtype_name)
    rng, qtype = np.random.default_rng(0), T[qtype_name.removesuffix("_M")]  # the mixes' main type: Q4_K, Q5_K
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    embedding = rng.standard_normal((vocab, hidden), dtype=np.float32) * 0.02
    if not tied:
        writer.add_tensor("token_embd.weight", _random_blocks(rng, vocab, hidden, qtype), raw_dtype=qtype)
        if mix:
            writer.add_tensor("output.weight", _random_blocks(rng, vocab, hidden, T.Q6_K), raw_dtype=T.Q6_K)
        else:
            writer.add_tensor("output.weight", gguf.quants.quantize(embedding, T.Q8_0), raw_dtype=T.Q8_0)
    else:
        writer.add_tensor("token_embd.weight", gguf.quants.quantize(embedding, T.Q8_0), raw_dtype=T.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for layer in range(layers):
        for name, dims in _layer_tensors(SHAPES[shape]):
            if len(dims) == 1:
                writer.add_tensor(f"blk.{layer}.{name}.weight", np.ones(dims, np.float32))
                continue
            more = mix and name in ("attn_v", "ffn_down") and _more_bits(layer, layers)
            kind = T.Q6_K if more else qtype
            writer.add_tensor(f"blk.{layer}.{name}.weight", _random_blocks(rng, *dims, kind), raw_dtype=kind)
        print(f"wrote layer {layer + 1}/{layers}", file=sys.stderr, flush=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _metadata(writer, source, shape: tuple[int, ...], qtype_name: str) -> None:
    """llama's keys for `shape`, and the bundled file's tokenizer keys copied as they are."""
    import gguf

    hidden, layers, heads, kv_heads, inner = shape
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_context_length(4096)
    writer.add_feed_forward_length(inner)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    types = {"F16": "MOSTLY_F16", "Q4_0": "MOSTLY_Q4_0", "Q4_K": "MOSTLY_Q4_K_S", "Q4_K_M": "MOSTLY_Q4_K_M"}
    types |= {"Q5_K_M": "MOSTLY_Q5_K_M", "Q6_K": "MOSTLY_Q6_K", "Q8_0": "MOSTLY_Q8_0", "IQ4_XS": "MOSTLY_IQ4_XS"}
    writer.add_file_type(gguf.LlamaFileType[types[qtype_name]])
    kinds = gguf.GGUFValueType
    for field in source.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == kinds.ARRAY:
            strings = field.types[-1] == kinds.STRING
            values = [bytes(field.parts[i]).decode() if strings else field.parts[i][0].item() for i in field.data]
            writer.add_array(field.name, values)
        elif kind == kinds.STRING:
            writer.add_string(field.name, bytes(field.parts[field.data[0]]).decode())
        else:
            writer.add_key_value(field.name, field.parts[field.data[0]][0].item(), kind)


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the layers whose attn_v and ffn_down Q4_K_M stores in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _random_blocks(rng, rows: int, cols: int, qtype):
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as T

    if qtype == T.Q4_K:  # well-formed blocks: random nibbles and 6-bit scales, small float16 super-block scales
        blocks = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
        blocks[..., 0:2] = np.full((rows, cols // 256, 1), 1.5e-3, np.float16).view(np.uint8)
        blocks[..., 2:4] = np.full((rows, cols // 256, 1), 2e-3, np.float16).view(np.uint8)
        return blocks.reshape(rows, -1)
    if qtype == T.IQ4_XS:  # d, 6-bit scales, 128 bytes of grid indices
        blocks = rng.integers(0, 256, (rows, cols // 256, 136), dtype=np.uint8)
        blocks[..., 0:2] = np.full((rows, cols // 256, 1), 2e-4, np.float16).view(np.uint8)
        return blocks.reshape(rows, -1)
    if qtype == T.Q5_K:  # Q4_K's with 32 bytes of fifth bits after the scales
        blocks = rng.integers(0, 256, (rows, cols // 256, 176), dtype=np.uint8)
        blocks[..., 0:2] = np.full((rows, cols // 256, 1), 1e-3, np.float16).view(np.uint8)
        blocks[..., 2:4] = np.full((rows, cols // 256, 1), 2e-3, np.float16).view(np.uint8)
        return blocks.reshape(rows, -1)
    if qtype == T.Q6_K:  # 128 bytes of low nibbles, 64 of high pairs, 16 int8 scales, a float16 scale
        blocks = rng.integers(0, 256, (rows, cols // 256, 210), dtype=np.uint8)
        blocks[..., 192:208] = rng.integers(1, 64, (rows, cols // 256, 16), dtype=np.uint8)
        blocks[..., 208:210] = np.full((rows, cols // 256, 1), 2e-4, np.float16).view(np.uint8)
        return blocks.reshape(rows, -1)
    return gguf.quants.quantize(rng.standard_normal((rows, cols), dtype=np.float32) * 0.02, qtype)
