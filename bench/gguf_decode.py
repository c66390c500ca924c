"""Decode step time of the bundled model as each start-up choice loads it, interleaved in one process.

Loads the bundled GGUF three ways: dense float32 (`--dtype float32`: what no flags served before GGUF files
were read natively), the file's own quantization (no flags now: Q4_1 → int4 groups of 32, Q8_0 head → int8),
and `--quantize int4`. Each is prefilled with one `--context`-token prompt; then `--steps` rounds time one
greedy batch-1 decode step of each in turn, so a busy shared machine loads them alike. Prints the median and
the fastest step, tok/s, the weight bytes a step reads and the GB/s the median implies, and ratios.

    PYTHONPATH=. .venv/bin/python bench/gguf_decode.py --steps 40
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kettle.hub import resolve_model
from kettle.models.registry import load_model
from tests.models.drive import new_cache, step

CHOICES = {"dense float32": {"dequantize": True}, "gguf default": {}, "--quantize int4": {"quantize": "int4"}}


def weight_bytes(model) -> int:
    """Bytes of every parameter and buffer but the embedding table (one row of it is read a step)."""
    # A oneDNN-packed head has no storage pointer: keyed by identity instead (it is never shared).
    tensors = {t.data_ptr() if not t.is_mkldnn else id(t): t for t in [*model.parameters(), *model.buffers()]}
    embed = model.embed_tokens  # None where a quantized table serves both (the head reads all of it every step)
    head = {t.data_ptr() for t in [*model.lm_head.parameters(), *model.lm_head.buffers()] if not t.is_mkldnn}
    skip = set() if embed is None or embed.data_ptr() in head else {embed.data_ptr()}
    return sum(t.numel() * t.element_size() for p, t in tensors.items() if p not in skip)


def stepper(model, context: int):
    """One greedy decode step of a batch-1 sequence after a `context`-token prefill."""
    blocks = (context + 1024) // 16 + 1  # room for up to ~1000 timed steps
    cache, table = new_cache(model, blocks), [list(range(blocks))]
    prompt = [list(range(1, context + 1))]
    logits, _ = step(model, cache, prompt, [0], table)
    state = {"token": int(logits[-1].argmax()), "len": context}

    def run() -> None:
        out, _ = step(model, cache, [[state["token"]]], [state["len"]], table)
        state["token"], state["len"] = int(out[-1].argmax()), state["len"] + 1

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--context", type=int, default=64)
    args = parser.parse_args()
    path = str(resolve_model().path)
    models = {name: load_model(path, torch.float32, "cpu", **kwargs) for name, kwargs in CHOICES.items()}
    steps = {name: stepper(model, args.context) for name, model in models.items()}
    times = {name: [] for name in models}
    for _ in range(3):  # warm-up
        for run in steps.values():
            run()
    for _ in range(args.steps):
        for name, run in steps.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    base = statistics.median(times["dense float32"])
    for name, model in models.items():
        median, best, size = statistics.median(times[name]), min(times[name]), weight_bytes(model)
        print(f"{name}: median {median * 1e3:.1f} ms ({1 / median:.1f} tok/s), fastest {best * 1e3:.1f} ms "
              f"({1 / best:.1f} tok/s), weights {size / 2**20:.0f} MiB a step, {size / median / 1e9:.2f} GB/s "
              f"at the median, {base / median:.2f}x dense")  # fmt: skip


if __name__ == "__main__":
    main()
