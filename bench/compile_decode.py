"""Does `torch.compile` pay for the CPU decode step? Eager vs compiled, with and without Kettle's C kernels.

Method: variants of one batched greedy decode step over the same prompts (same seed), each with its own KV
cache: eager with Kettle's C kernels, eager without (`KETTLE_CPU_KERNELS=0`, switched per call so both run
in this process: float32 layers choose per call; int4 chooses its layer class at load, so loads twice),
and `torch.compile` of the model's forward without or with the kernels. Prefill runs eager; a compiled
variant's first `--warmup` decode steps (tracing, compiling, recompiling) are timed apart as its compile
time. Then all steps run interleaved (bench/model_decode.py's `timed`), so every variant sees the same load
of the shared machine; medians. Each variant's greedy tokens are compared with its eager twin's.

What compiling takes here (torch 2.13 CPU): the undecorated forward (through its `inference_mode` decorator
AOTAutograd fails, "Cannot set version_counter for inference tensor"), inductor freezing (oneDNN-packed
weights lower only as constants), and automatic dynamic shapes (`dynamic=None`: `dynamic=True` with freezing
generates code using an undefined size symbol). Then the no-kernel forward is one graph, recompiled twice
(context length, block count), no graph break. With the kernels, dynamo breaks the graph at every ctypes call
(84 breaks, 50 graphs) and hits its recompile limit on per-layer frames; run that variant in its own process
(`--variants eager-kernels compiled-kernels`) or it leaves the shared code objects falling back to eager.

    .venv/bin/python bench/compile_decode.py ~/.cache/kettle/models/<bundled> --batch 1 16 \
        --variants eager-kernels eager-nokernels compiled-nokernels
    .venv/bin/python bench/compile_decode.py ~/.cache/kettle/models/<bundled> --batch 1 16 \
        --variants eager-kernels compiled-kernels
    (and the same with --quantize int4, or --mode max-autotune-no-cudagraphs)

Measured (SmolLM2-135M-Instruct bundled, context 128, 1 thread on 2 cores shared with another benchmark, load
average 2-6; median ms/step of 20 interleaved steps; x = speed-up over eager with kernels, same process):

    float32                    batch 1          batch 16         compile (1 thread)
    eager, kernels             48.3 (20.7/s)    135.6 (118/s)    -
    eager, no kernels          53.8  x0.90      142.5  x0.95     -
    compiled, no kernels       42.9  x1.13      133.0  x1.02     68-71 s, same tokens   (rerun: x1.11, x1.01)
    compiled, kernels          69.2  x0.68      166.1  x0.80     16-18 s (84 breaks)    (own process)
    max-autotune, no kernels   36.6  x1.48      138.2  x1.10     116-127 s, same tokens (eager 54.3 / 152.0)

    int4                       batch 1          batch 16
    eager, kernels (Q4Linear)  24.4 (41.0/s)    148.2 (108/s)
    eager, no kernels          37.6  x0.65      171.6  x0.86
    compiled, no kernels       26.4  x0.92      150.5  x0.99     66-70 s; batch 16 tokens differ from eager
    max-autotune, no kernels   31.6  x0.92      -                59 s, same tokens (eager 29.0)

max-autotune wins by replacing oneDNN's linear with inductor's C++ micro-GEMM for most projections at these
shapes (autotune log: 0.15 vs 0.20 ms, 0.40 vs 0.47 ms). With the kernels a compiled forward is slower than
eager; under int4 compiling does not beat Kettle's Q4 kernel. The price of freezing: resident memory after
20 compiled batch-1 steps 2.93 GB against 1.41 GB eager (likely the 0.54 GB of weights held again as constants
of each of the 3 graphs), plus ~2 minutes of compiling per process.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).parent))
from model_decode import timed

from kettle import settings
from kettle.kernels import ops
from kettle.layers.attention import AttentionMetadata
from kettle.models.registry import load_model
from kettle.tensors.kv_cache import BLOCK_SIZE, KVCache

_REAL_LIBRARY = ops.library
DYNAMIC = {"true": True, "false": False, "auto": None}


def _no_library() -> None:
    return None


@contextlib.contextmanager
def kernels(on: bool) -> Iterator[None]:
    """Kettle's C kernels on or off for the calls inside (what `KETTLE_CPU_KERNELS=0` does at startup)."""
    ops.library = _REAL_LIBRARY if on else _no_library
    try:
        yield
    finally:
        ops.library = _REAL_LIBRARY


def load(path: str, quantize: str | None, with_kernels: bool, linear: str):
    """The model under `quantize`, loaded with the kernels on or off (int4 picks its layer class here) and the
    float32 weights in the `KETTLE_CPU_LINEAR` layout `linear`."""
    previous = os.environ.get("KETTLE_CPU_LINEAR")
    os.environ["KETTLE_CPU_LINEAR"] = linear
    settings.reload()  # the process reads its settings once: read them again for this load
    try:
        with kernels(with_kernels):
            return load_model(path, torch.float32, torch.device("cpu"), quantize=quantize)
    finally:
        os.environ.pop("KETTLE_CPU_LINEAR")
        if previous is not None:
            os.environ["KETTLE_CPU_LINEAR"] = previous
        settings.reload()


def decode_step(model, forward: Callable, with_kernels: bool, batch: int, context: int, total_steps: int, seed: int):
    """A closure running one batched greedy decode step per call through `forward`; it logs its tokens."""
    with torch.inference_mode():  # as the shard runs its steps: the cache and every activation inference tensors
        return _decode_step(model, forward, with_kernels, batch, context, total_steps, seed)


def _decode_step(model, forward: Callable, with_kernels: bool, batch: int, context: int, total_steps: int, seed: int):
    spec = model.spec
    blocks_per_seq = -(-(context + total_steps + 1) // BLOCK_SIZE)
    cache = KVCache(
        spec.num_layers, batch * blocks_per_seq, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, spec.dtype, "cpu"
    )
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
    prompts = torch.randint(0, spec.vocab_size, (batch * context,), generator=torch.Generator().manual_seed(seed))
    meta = AttentionMetadata.build([context] * batch, [0] * batch, tables, BLOCK_SIZE, "cpu")
    with kernels(with_kernels):
        hidden = model.forward(prompts, meta.positions, cache, meta)
        first = model.compute_logits(hidden[meta.last_token_indices]).argmax(-1)
    state = {"tokens": first, "len": context, "log": [first]}

    def step() -> None:
        meta = AttentionMetadata.build([1] * batch, [state["len"]] * batch, tables, BLOCK_SIZE, "cpu")
        with kernels(with_kernels), torch.inference_mode():
            hidden = forward(state["tokens"], meta.positions, cache, meta)
            state["tokens"] = model.compute_logits(hidden).argmax(-1)
        state["log"].append(state["tokens"])
        state["len"] += 1

    step.tokens = lambda: torch.stack(state["log"], 1)  # [batch, steps + 1]
    return step


# name: (compiled, with kernels). Run the compiled ones with and without kernels in separate processes: they
# share the model's code objects, and the one with kernels exhausts dynamo's recompile limit on them (one
# recompile per layer after each ctypes graph break), which leaves the other falling back to eager.
VARIANTS = {
    "eager-kernels": (False, True),
    "eager-nokernels": (False, False),
    "compiled-nokernels": (True, False),
    "compiled-kernels": (True, True),
}


def variants(path: str, quantize: str | None, batch: int, args: argparse.Namespace) -> tuple[list, list]:
    """(step closures, compile seconds or None) for the variants `args.variants` at `batch`."""
    total = args.steps + 2 * args.warmup  # compiled variants run their warm-up twice
    models: dict = {}  # one model per (kernels at load, linear layout): float32 layers choose kernels per call
    steps, compile_s = [], []
    for name in args.variants:
        compiled, with_kernels = VARIANTS[name]
        linear = args.compile_linear if compiled else args.eager_linear
        key = (with_kernels or quantize is None, linear)
        if key not in models:
            models[key] = load(path, quantize, with_kernels, linear)
        model = models[key]
        forward = model.forward
        if compiled:
            # The undecorated forward (the step enters inference mode itself): tracing through the decorator's
            # mode switch fails in AOTAutograd ("Cannot set version_counter for inference tensor").
            plain = functools.partial(type(model).forward.__wrapped__, model)
            forward = torch.compile(plain, dynamic=DYNAMIC[args.dynamic], mode=args.mode)
        step = decode_step(model, forward, with_kernels, batch, args.context, total, args.seed)
        seconds = None
        if compiled:  # compile outside the timing: the first steps trace (and recompile)
            start = time.perf_counter()
            for _ in range(args.warmup):
                step()
            seconds = time.perf_counter() - start
        steps.append(step)
        compile_s.append(seconds)
    return steps, compile_s


def same_tokens(names: list[str], tokens: list[torch.Tensor], i: int) -> str:
    """Whether variant i's greedy tokens match those of the eager variant with its kernel setting."""
    for j, name in enumerate(names):
        if not VARIANTS[name][0] and VARIANTS[name][1] == VARIANTS[names[i]][1] and j != i:
            n = min(tokens[i].shape[1], tokens[j].shape[1])
            return "same tokens" if torch.equal(tokens[i][:, :n], tokens[j][:, :n]) else "TOKENS DIFFER"
    return "no eager twin"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="a model folder (config.json + safetensors)")
    parser.add_argument("--quantize", default=None, choices=[None, "int4", "int8"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS)[:3], choices=list(VARIANTS))
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--mode", default=None, help="torch.compile mode, e.g. max-autotune-no-cudagraphs")
    parser.add_argument("--seed", type=int, default=0)
    # One thread: the 2 cores are shared, and two 2-thread OpenMP processes on them spin-wait each other ~25x slower.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dynamic", default="auto", choices=list(DYNAMIC), help="torch.compile's dynamic")
    parser.add_argument(
        "--freezing", action=argparse.BooleanOptionalAction, default=True, help="inductor freezing (weights constant)"
    )
    parser.add_argument("--eager-linear", default="onednn", choices=["onednn", "transposed", "dense"])
    parser.add_argument("--compile-linear", default="onednn", choices=["onednn", "transposed", "dense"])
    args = parser.parse_args()
    torch._inductor.config.freezing = args.freezing
    torch.set_num_threads(args.threads)
    load_avg = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{args.quantize or 'float32'}, context {args.context}, {args.threads} threads, load average {load_avg}")
    for batch in args.batch:
        torch._dynamo.reset()
        counters.clear()
        steps, compile_s = variants(args.path, args.quantize, batch, args)
        seconds = timed(steps, args.steps, args.warmup)
        tokens = [step.tokens() for step in steps]
        for i, (name, s, c) in enumerate(zip(args.variants, seconds, compile_s, strict=True)):
            line = f"batch {batch:3d} {name:18s} {s * 1e3:8.2f} ms/step {batch / s:8.1f} tok/s  x{seconds[0] / s:.2f}"
            if c is not None:
                line += f"  compile+warmup {c:5.1f} s  {same_tokens(args.variants, tokens, i)}"
            print(line, flush=True)
        breaks = sum(counters["graph_break"].values())
        print(f"  dynamo: {counters['stats']['unique_graphs']} graphs, {breaks} graph breaks", flush=True)


if __name__ == "__main__":
    main()
