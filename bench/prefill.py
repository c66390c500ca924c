"""Prefill: one long prompt in process against transformers and llama.cpp; served, the streams it holds up and
the time to first token a cached prefix saves.

    .venv/bin/python -m bench prefill                             # bundled model, 1,000 tokens, 7 trials
    .venv/bin/python -m bench prefill --schemes int4 --tokens 2000 --trials 5
    .venv/bin/python -m bench prefill --sdpa                      # + float32 with SDPA's attention kernel
    .venv/bin/python -m bench prefill --chunk 256 --schemes float32 --sdpa   # Kettle in 256-token chunks
    KETTLE_TUNING=cpu-kernels=off .venv/bin/python -m bench prefill ...   # PyTorch's ops, not Kettle's kernels

In process (the default): each engine prefills the same `--tokens` random token ids, one prompt, nothing cached,
and computes the logits of the last position (what a shard does before sampling the first token). Kettle goes
the way the shard's runner does (kettle/bench/drive.py's PrefillLoop, over a fresh paged cache in the shard's KV
dtype) in each of `--schemes`; transformers runs one `model(ids, logits_to_keep=1)` call (what `generate` does
for the prompt); llama.cpp (llama-cpp-python, when installed, on the bundled GGUF) evaluates the prompt in one
batch. The engines run interleaved, trial by trial; the table gives each one's median, its ratio to
transformers, and the FLOP/s it achieved against the machine's peak.

`--chunked`: inter-token latency of running streams while a long prompt is prefilled, with chunked prefill on and
off. A server per mode: chunking with the adaptive chunk size (the default; `--budget N` sets
`--max-batch-prefill-tokens`), with a fixed one (`KETTLE_TUNING=adaptive-chunks=off`), and `--disable-chunked-prefill`
(`--modes` picks them by prefix). Per trial, `--streams` greedy streams start; once each has `--lead-tokens`
tokens, a prompt of about `--tokens` tokens (2,000 by default; unique per trial, so never a prefix-cache hit)
arrives. Printed per mode: the median, p99 and max of the running streams' inter-token gaps (all, and those
overlapping the long prompt's prefill) and the long prompt's time to first token. The target: p99 <= 3x median
while it is prefilled.

    .venv/bin/python -m bench prefill --chunked --streams 2 --stream-tokens 48 --tokens 500 --trials 1

`--prefix-cache`: time to first token with and without prefix caching, for prompts that share a long prefix. Each
trial builds a fresh prefix of about `--tokens` tokens (1,000 by default), then streams prefix + question A (a
full prefill) and prefix + question B (a cache hit when prefix caching is on), against a server with prefix
caching and one with `--disable-prefix-caching`; medians, and the second request's speed-up.

`python -m bench vision` (an image's encode time and time to first token) is the section at the end of this file.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kettle.bench.loadgen import (
    StreamTiming,
    chat_prompts,
    percentile,
    prompt_of_tokens,
    run_load,
    session,
    stream_tokens,
)
from kettle.bench.process import KettleServer
from kettle.bench.timing import interleaved, ratio_summary, same_round


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench prefill", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("path", nargs="?", help="a model folder or Hub id (default: the bundled model)")
    p.add_argument("--tokens", type=int, help="prompt tokens (1,000; 2,000 with --chunked)")
    p.add_argument("--trials", type=int, help="trials (7; --chunked 3, --prefix-cache 5)")
    p.add_argument("--schemes", nargs="+", default=["float32", "int4", "int8"], help="Kettle's weights")
    p.add_argument("--threads", type=int, default=2, help="in process: torch threads")
    p.add_argument("--no-peers", action="store_true", help="in process: Kettle only (no transformers, llama.cpp)")
    p.add_argument("--sdpa", action="store_true", help="in process: also Kettle float32 with SDPA's attention")
    p.add_argument("--chunk", type=int, help="in process: Kettle prefills CHUNK tokens a forward")
    p.add_argument("--chunked", action="store_true", help="served: running streams while a long prompt prefills")
    p.add_argument("--prefix-cache", action="store_true", help="served: TTFT with and without prefix caching")
    p.add_argument("--streams", type=int, default=4, help="--chunked: running streams")
    p.add_argument("--stream-tokens", type=int, default=128, help="--chunked: max_new_tokens of each stream")
    p.add_argument("--lead-tokens", type=int, default=8, help="--chunked: tokens every stream has before the prompt")
    p.add_argument("--budget", type=int, help="--chunked: --max-batch-prefill-tokens with chunking on")
    p.add_argument("--modes", default="chunked,--disable", help="--chunked: prefixes of the modes to run")
    p.add_argument("--server-args", default="", help="served: extra `kettle launch` flags")
    return p


def prefill(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    if args.chunked:
        args.tokens, args.trials = args.tokens or 2000, args.trials or 3
        return chunked(args)
    if args.prefix_cache:
        args.tokens, args.trials = args.tokens or 1000, args.trials or 5
        return prefix_cache(args)
    args.tokens, args.trials = args.tokens or 1000, args.trials or 7
    in_process(args)


def resolved(path: str | None) -> str:
    from kettle.hub.resolve import resolve_model

    return str(resolve_model(path).path)


# ---- in process -----------------------------------------------------------------------------------------------


def in_process(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    path = resolved(args.path)
    config = json.loads((Path(path) / "config.json").read_text())
    ids = torch.randint(0, config["vocab_size"], (args.tokens,), generator=torch.Generator().manual_seed(0))
    fns = {f"kettle {scheme}": kettle_prefill(path, scheme, ids, args.chunk) for scheme in args.schemes}
    if args.sdpa:
        fns["kettle float32, SDPA attention"] = kettle_prefill(path, "float32", ids, args.chunk, sdpa=True)
    if not args.no_peers:
        fns["transformers float32"] = transformers_prefill(path, ids)
        if (llama := llama_cpp_prefill(ids, args.threads)) is not None:
            fns["llama.cpp Q4_1"] = llama
    timings = interleaved(list(fns.values()), args.trials)
    report({name: t.median for name, t in zip(fns, timings, strict=True)}, prefill_flops(config, args.tokens), args)


def kettle_prefill(path: str, scheme: str, ids, chunk: int | None, sdpa: bool = False):
    """Kettle's prefill of `ids` (`sdpa`: attention on PyTorch's SDPA instead of Kettle's kernel, as
    `KETTLE_TUNING=prefill-attention=off`)."""
    import torch

    from kettle.bench.drive import PrefillLoop, tuning
    from kettle.models.registry import load_model

    def attention():
        return tuning({"prefill-attention": not sdpa})

    model = load_model(path, torch.float32, "cpu", quantize=None if scheme == "float32" else scheme)
    return PrefillLoop(model, ids, chunk, around=attention)


def transformers_prefill(path: str, ids):
    """One transformers forward over the prompt per call, logits of the last position only."""
    import torch

    from kettle.bench.drive import transformers_model

    model = transformers_model(path, torch.float32)

    @torch.inference_mode()
    def run() -> None:
        model(ids.unsqueeze(0), use_cache=True, logits_to_keep=1).logits.argmax(-1)

    return run


def llama_cpp_prefill(ids, threads: int):
    """llama.cpp evaluating the prompt in one batch on the bundled GGUF; None when llama-cpp-python is missing."""
    try:
        from llama_cpp import Llama
    except ImportError:
        print("skipped llama.cpp: llama-cpp-python is not installed (make bench-peers installs it)")
        return None
    from kettle.hub.resolve import bundled_gguf

    tokens = len(ids)
    llm = Llama(
        str(bundled_gguf()), n_ctx=tokens + 16, n_batch=tokens, n_ubatch=tokens, n_threads=threads, verbose=False
    )
    prompt = (ids % llm.n_vocab()).tolist()

    def run() -> None:
        llm.reset()
        llm.eval(prompt)

    return run


def prefill_flops(config: dict, tokens: int) -> float:
    """Multiply-adds ×2 of one prefill: every projection for every token, causal attention, one LM head row."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim", hidden // heads)
    projections = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    projections += 3 * hidden * config["intermediate_size"]
    attention = 2 * heads * head_dim * tokens * (tokens + 1) / 2  # QKᵀ and PV over the causal triangle
    return 2 * layers * (projections * tokens + attention) + 2 * hidden * config["vocab_size"]


def peak_flops(threads: int) -> tuple[float, str]:
    """threads × 2 FMA units × lanes × 2 FLOP × the clock /proc/cpuinfo reports: AVX-512 lanes when present,
    except on AMD's Zen 4 (family 25), whose FMA units are 256 bits wide and run a 512-bit one in two halves."""
    text = Path("/proc/cpuinfo").read_text()
    mhz = float(next(line for line in text.splitlines() if line.startswith("cpu MHz")).split(":")[1])
    zen4 = "AuthenticAMD" in text and re.search(r"^cpu family\s*:\s*25$", text, re.M) is not None
    lanes = 16 if " avx512f" in text and not zen4 else 8
    return threads * 2 * lanes * 2 * mhz * 1e6, f"{threads} cores x 2 FMA x {lanes} lanes x 2 x {mhz:.0f} MHz"


def report(seconds: dict[str, float], flops: float, args: argparse.Namespace) -> None:
    peak, formula = peak_flops(args.threads)
    base = seconds.get("transformers float32")
    chunks = f", Kettle in chunks of {args.chunk}" if args.chunk else ""
    print(f"{args.tokens}-token prefill{chunks}, {args.threads} threads, median of {args.trials} interleaved trials")
    print(f"{flops / 1e9:.1f} GFLOP per prefill; peak {peak / 1e9:.0f} GFLOP/s ({formula})")
    print("| engine | ms | tok/s | vs transformers | GFLOP/s | % of peak |\n|---|---|---|---|---|---|")
    for name, s in seconds.items():
        ratio = f"{base / s:.2f}x" if base else "-"
        gflops, share = flops / s / 1e9, flops / s / peak
        print(f"| {name} | {s * 1e3:.0f} | {args.tokens / s:.1f} | {ratio} | {gflops:.1f} | {share:.0%} |")


# ---- --chunked: running streams while a long prompt is prefilled ----------------------------------------------


@dataclass
class Trial:
    """The running streams of one trial and the long prompt's send / first-token times."""

    streams: list[StreamTiming]
    sent: float
    first_token: float

    def gaps(self, during: bool) -> list[float]:
        """Inter-token gaps of the running streams; `during`: only those overlapping the long prefill."""
        out = []
        for stream in self.streams:
            for a, b in zip(stream.arrivals, stream.arrivals[1:], strict=False):
                if not during or (b > self.sent and a < self.first_token):
                    out.append(b - a)
        return out


async def run_trial(url: str, prompts: list[str], long: str, args: argparse.Namespace) -> Trial:
    async with session() as client:
        timings = [StreamTiming(time.perf_counter()) for _ in range(args.streams)]
        calls = [
            stream_tokens(client, url, prompts[i % len(prompts)], args.stream_tokens, t) for i, t in enumerate(timings)
        ]
        running = [asyncio.create_task(c) for c in calls]
        while min(len(t.arrivals) for t in timings) < args.lead_tokens:
            await asyncio.sleep(0.005)
        probe = StreamTiming(time.perf_counter())
        await stream_tokens(client, url, long, 2, probe)
        await asyncio.gather(*running)
    return Trial(timings, probe.start, probe.arrivals[0])


def chunked_mode(model_path: str, flags: list[str], env: dict[str, str], args: argparse.Namespace) -> list[Trial]:
    flags = ["--max-concurrent-requests", "64", *flags, *args.server_args.split()]
    server = KettleServer(model_path, *flags, env=env, timeout=900)  # a loaded machine starts slowly
    try:
        prompts = chat_prompts(model_path)
        lead = "Summarise the following notes:"
        warm = prompt_of_tokens(server.url, args.tokens, -1, lead)
        asyncio.run(run_trial(server.url, prompts, warm, args))
        trials = []
        for n in range(args.trials):
            long = prompt_of_tokens(server.url, args.tokens, n, lead)
            trials.append(asyncio.run(run_trial(server.url, prompts, long, args)))
        return trials
    finally:
        server.stop()


def chunked_row(name: str, trials: list[Trial]) -> str:
    """One table row: latencies in milliseconds."""

    def stats(gaps: list[float]) -> str:
        median, p99 = statistics.median(gaps), percentile(gaps, 0.99)
        ratio = f"{p99 / median:.2f}x" if median > 0 else "-"
        return f"{median * 1e3:.1f} | {p99 * 1e3:.1f} | {max(gaps) * 1e3:.1f} | {ratio}"

    every = [g for t in trials for g in t.gaps(during=False)]
    during = [g for t in trials for g in t.gaps(during=True)]
    ttft = statistics.median(t.first_token - t.sent for t in trials)
    return f"| {name} | {stats(every)} | {stats(during)} | {ttft * 1e3:.1f} |"


def chunked(args: argparse.Namespace) -> None:
    model_path = resolved(args.path)
    on = ["--max-batch-prefill-tokens", str(args.budget)] if args.budget else []
    budget = args.budget or "default"
    modes = {
        f"chunked, adaptive (max {budget})": (on, {}),
        f"chunked, fixed {budget}": (on, {"KETTLE_TUNING": "adaptive-chunks=off"}),
        "--disable-chunked-prefill": (["--disable-chunked-prefill"], {}),
    }
    chosen = [m for m in modes if any(m.startswith(p) for p in args.modes.split(","))]
    print(f"{args.streams} streams, {args.tokens}-token prompt, {args.trials} trials; times in ms")
    print(
        "| mode | ITL p50 | ITL p99 | ITL max | p99/p50 | during prefill: ITL p50 | p99 | max | p99/p50 | long TTFT |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for name in chosen:  # each row as soon as it is measured
        print(chunked_row(name, chunked_mode(model_path, *modes[name], args)), flush=True)


# ---- --prefix-cache: time to first token on a shared prefix ---------------------------------------------------


def ttft(url: str, inputs: str) -> float:
    """Seconds until the first streamed token of a greedy request (4 tokens, so the server is idle after)."""
    return asyncio.run(run_load(url, [inputs], 1, 4)).streams[0].ttft


def prefix_mode(flags: list[str], args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """TTFT of the first and of the second request of each trial, on a server started with `flags`."""
    server = KettleServer(args.path, *flags, *args.server_args.split())
    try:
        ttft(server.url, "warm up")
        firsts, seconds = [], []
        for trial in range(args.trials):
            prefix = prompt_of_tokens(server.url, args.tokens, trial)
            firsts.append(ttft(server.url, prefix + " Question: what is brewed first?"))
            seconds.append(ttft(server.url, prefix + " Question: which cup is the largest?"))
        return firsts, seconds
    finally:
        server.stop()


def prefix_cache(args: argparse.Namespace) -> None:
    rows = []
    for name, flags in (("prefix caching on", []), ("--disable-prefix-caching", ["--disable-prefix-caching"])):
        firsts, seconds = prefix_mode(flags, args)
        rows.append((name, statistics.median(firsts), statistics.median(seconds)))
    print(f"{'server':28} {'TTFT 1st (miss) ms':>20} {'TTFT 2nd ms':>14} {'2nd speedup':>12}")
    for name, first, second in rows:
        print(f"{name:28} {first * 1000:20.1f} {second * 1000:14.1f} {first / second:11.2f}x")
    print(f"hit vs no cache, 2nd request: {rows[1][2] / rows[0][2]:.2f}x faster")


# ---- images: one image's encode time and time to first token (`python -m bench vision`) -------------------------

VISION = """Vision: one image's encode time and the time to its first token, Kettle in process against transformers.

    .venv/bin/python -m bench vision                       # SmolVLM-256M's shape, random weights, a 512x512 image
    .venv/bin/python -m bench vision --longest-edge 2048   # SmolVLM's own resize: a 4 x 4 grid of tiles + the image
    .venv/bin/python -m bench vision --trials 5 --size 512

No network: the model is built from transformers' Idefics3 config in SmolVLM-256M's shape (a SigLIP-B/16 tower on
512-pixel tiles, pixel shuffle by 4: 64 tokens a tile; a 30-layer Llama of width 576) with random float32 weights
and the tiny test tokenizer, saved to a temporary folder, and loaded by both. Per trial, interleaved:

- encode: the image processor's batch (made once) through the vision tower and connector: Kettle's
  `encode_images` against transformers' `get_image_features`;
- first token: from the image's file to the first token's logits, preprocessing included: Kettle's shard path
  (ImageInputs' processor batch, `encode_images`, a prefill over a fresh paged cache with the image rows, the last
  position's logits) against transformers' processor and one `model(**inputs, logits_to_keep=1)`.

Printed: each side's median seconds and Kettle's same-round ratio to transformers (below 1: Kettle faster).
"""


def vision_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench vision", description=VISION.split("\n\n")[0])
    p.add_argument("--size", type=int, default=512, help="the image's side in pixels (default 512)")
    p.add_argument("--longest-edge", type=int, default=512, help="the processor's resize target (SmolVLM: 2048)")
    p.add_argument("--trials", type=int, default=3)
    return p


def build_vision_model(folder: Path, longest_edge: int) -> None:
    """A random SmolVLM-256M-shaped Idefics3 with the tiny tokenizer and its processor, in `folder`."""
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    from tests.fixtures import make_tokenizer

    tokenizer = make_tokenizer(folder)
    tags = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<fake_token_around_image>", "<image>", "<global-img>", *tags]}
    )
    tokenizer.save_pretrained(folder)
    images = Idefics3ImageProcessorPil(size={"longest_edge": longest_edge}, max_image_size={"longest_edge": 512})
    Idefics3Processor(images, tokenizer, image_seq_len=64).save_pretrained(folder)
    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)
    vision |= dict(image_size=512, patch_size=16)
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536)
    text |= dict(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192)
    text |= dict(tie_word_embeddings=False)
    config = Idefics3Config(
        vision_config=vision,
        text_config=text,
        scale_factor=4,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).eval().save_pretrained(folder, safe_serialization=True)


def vision(argv) -> None:
    import torch
    from PIL import Image
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    from bench.__main__ import command
    from kettle.bench.drive import new_cache, scattered_tables, step
    from kettle.models.registry import load_model
    from kettle.shard.image_inputs import ImageInputs, load_image_processor
    from tests.vision_fixtures import image_bytes

    args = vision_parser().parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_vision_model(folder, args.longest_edge)
        model = load_model(str(folder), torch.float32, "cpu")
        reference = Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        processor = AutoProcessor.from_pretrained(folder)
        images = ImageInputs(model, load_image_processor(str(folder)))
    png = image_bytes("PNG", (args.size, args.size), seed=1)
    text = "<|im_start|>user\n<image>What is in this picture?<|im_end|>\n<|im_start|>assistant\n"
    inputs = processor(text=text, images=[[Image.open(io.BytesIO(png))]], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    features = images.features([png])
    image_token = model.image_token_id

    def kettle_encode():
        return model.encode_images(**features)

    def hf_encode():
        with torch.inference_mode():
            return reference.model.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"])

    def kettle_first_token():
        (rows,) = model.encode_images(**images.features([png]))
        model.image_rows.set(torch.tensor([i for i, t in enumerate(ids) if t == image_token]), rows)
        tables, blocks = scattered_tables([len(ids)])
        logits, _ = step(model, new_cache(model, blocks), [ids], [0], tables)
        return logits[-1].argmax()

    def hf_first_token():
        batch = processor(text=text, images=[[Image.open(io.BytesIO(png))]], return_tensors="pt")
        with torch.inference_mode():
            return reference(**batch, logits_to_keep=1).logits[0, -1].argmax()

    tiles = int((inputs["pixel_values"][0].flatten(1) != 0).any(1).sum())
    print(f"# {command(['vision', *argv])}")
    print(f"# image {args.size}x{args.size}: {tiles} tiles, {ids.count(image_token)} image tokens, prompt {len(ids)}")
    assert int(kettle_first_token()) == int(hf_first_token()), "the two first tokens differ"
    for name, pair in (("encode", (kettle_encode, hf_encode)), ("first token", (kettle_first_token, hf_first_token))):
        kettle, hf = interleaved(pair, args.trials)
        ratio = ratio_summary(same_round(kettle.samples, hf.samples))
        print(f"{name:12s} Kettle {kettle.median:.3f} s  transformers {hf.median:.3f} s  Kettle/transformers {ratio}")
    print(f"# medians of {args.trials} interleaved trials, {torch.get_num_threads()} torch threads")
