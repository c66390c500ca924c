"""Kettle's benchmarks: `python -m bench NAME [options]` from the repository root (`.venv/bin/python -m bench ...`).

    .venv/bin/python -m bench                    # the list of benchmarks
    .venv/bin/python -m bench NAME --help        # one benchmark's method and options

Each benchmark prints the exact command that produced its numbers and the ratios of Kettle against what it is
compared with, measured in the same run (interleaved where it can be, so a shared machine's drift hits every side
alike: quote those ratios, not absolute numbers across runs). Dated results go to bench/RESULTS.md (GPU serving:
bench/GPU_RESULTS.md); how Kettle gets them is docs/performance.md. The benchmarks share one server launcher
(kettle/bench/process.py), one HTTP measuring loop (kettle/bench/loadgen.py), one offline driver
(kettle/bench/drive.py) and one timing helper (kettle/bench/timing.py).
"""

from __future__ import annotations

import importlib
import os
import shlex
import sys
from collections.abc import Callable, Sequence

# name → (module:function, what it measures). Each function takes the benchmark's arguments.
BENCHMARKS = {
    "peers": (
        "bench.peers:peers",
        "Kettle over HTTP against transformers, llama.cpp and CTranslate2 (make bench, make bench-peers); "
        "--shape: a 1.1B-shaped GGUF against llama.cpp",
    ),
    "decode": (
        "bench.decode:decode",
        "a decode step in process: batch sizes, schemes, kernels' switches, KV dtypes, torch.compile, the "
        "transformers fallback, against transformers' step",
    ),
    "prefill": (
        "bench.prefill:prefill",
        "a long prompt's prefill against transformers and llama.cpp; --chunked: running streams while it is "
        "prefilled; --prefix-cache: time to first token on a shared prefix",
    ),
    "served": (
        "bench.served:served",
        "a served stream against the bare decode step; --trees, --shards, --grammar, --load: servers compared",
    ),
    "speculation": ("bench.served:speculation", "--speculate N and overlap scheduling, over HTTP or in process"),
    "lora": ("bench.served:lora", "LoRA adapters' cost: served streams over 4 adapters, or one decode step (--step)"),
    "memory": (
        "bench.served:memory",
        "the shard's resident memory apart from its KV cache, beside llama.cpp's; --schemes: per weight scheme; "
        "--router: the router's under huge prompts",
    ),
    "startup": (
        "bench.served:startup",
        "seconds from `kettle launch` to a healthy server, cache empty, then filled",
    ),
    "vision": (
        "bench.prefill:vision",
        "one image's encode time and time to first token (SmolVLM-256M's shape, random weights) against transformers",
    ),
    "gpu": (
        "bench.gpu:gpu",
        "decode on a CUDA GPU against transformers: graphs, fp8, int8/int4, KV dtypes, int4 kernels",
    ),
    "serving": (
        "bench.serving:serving",
        "many concurrent ShareGPT-length requests through the server (Llama-3.1-8B's shape on a GPU): tok/s, "
        "TTFT, ITL, KV use, against transformers' batched generate",
    ),
}


def benchmark(name: str) -> Callable[[Sequence[str]], None]:
    """The function that runs benchmark `name`."""
    module, function = BENCHMARKS[name][0].split(":")
    return getattr(importlib.import_module(module), function)


def command(argv: Sequence[str]) -> str:
    """The command line that reproduces this run: the KETTLE_* and thread variables set, then the arguments."""
    names = sorted(k for k in os.environ if k.startswith("KETTLE_") or k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"))
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in names]
    python = os.path.relpath(sys.executable) if os.path.relpath(sys.executable).startswith(".venv") else "python3"
    return " ".join([*env, python, "-m bench", *map(shlex.quote, argv)])


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    rows = [f"  {name:{width}}  {what}" for name, (_, what) in BENCHMARKS.items()]
    return "usage: python -m bench NAME [options]   (NAME --help: its method and options)\n\n" + "\n".join(rows)


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in BENCHMARKS:
        print(f"unknown benchmark {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if "-h" not in argv and "--help" not in argv:
        print("command:", command(argv), flush=True)
    from kettle.process_memory import reuse_freed_memory

    reuse_freed_memory()  # the steps measured in this process keep their memory from one to the next, as a shard's do
    benchmark(argv[0])(list(argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
