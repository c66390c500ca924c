"""Whole-model decode with weight-only quantization, against float32 and transformers, plus peak memory.

Decode: loads the model once per variant (Kettle float32, int8, int4 with each LM-head choice) and
transformers float32, then times single-stream greedy decode steps of all of them interleaved step by
step (bench/model_decode.py's method), so every variant sees the same machine load; prints each one's
tokens/s and its speed-up over transformers float32.

Memory (`--memory`): for each scheme, a fresh process loads the model, decodes a few steps and reports its
resident set while serving and its peak (VmRSS, VmHWM): a shard process's memory under that scheme.

    .venv/bin/python bench/quant_decode.py ~/.cache/kettle/models/<bundled> --threads 2 --memory
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_decode import kettle_decode, timed, transformers_decode

from kettle import settings
from kettle.models.registry import load_model

# (label, --quantize, KETTLE_QUANT_LM_HEAD)
VARIANTS = [
    ("kettle fp32", None, None),
    ("kettle int8", "int8", None),
    ("kettle int4 (int8 head)", "int4", "int8"),
    ("kettle int4 (int4 head)", "int4", "int4"),
]


def load_variant(path: str, quantize: str | None, head: str | None):
    """The model under `quantize`, with the LM head scheme `head` (None: the default)."""
    if head is not None:
        os.environ["KETTLE_QUANT_LM_HEAD"] = head
    settings.reload()  # the process reads its settings once: read them again for this load
    try:
        return load_model(path, torch.float32, torch.device("cpu"), quantize=quantize)
    finally:
        os.environ.pop("KETTLE_QUANT_LM_HEAD", None)
        settings.reload()


def decode(args: argparse.Namespace) -> None:
    total = args.steps + args.warmup
    labels, fns = [], []
    for label, quantize, head in VARIANTS:
        labels.append(label)
        fns.append(kettle_decode(load_variant(args.path, quantize, head), 1, args.context, total))
    labels.append("transformers fp32")
    fns.append(transformers_decode(args.path, torch.float32, 1, args.context))
    seconds = timed(fns, args.steps, args.warmup)
    base = seconds[-1]
    print(f"single stream, context {args.context}, {torch.get_num_threads()} threads, median of {args.steps} steps")
    for label, s in zip(labels, seconds, strict=True):
        print(f"{label:26s} {s * 1e3:8.2f} ms/step {1 / s:8.1f} tok/s  x{base / s:.2f} vs transformers fp32")


def status_mib(field: str) -> float:
    """A memory line of /proc/self/status (VmRSS: resident now, VmHWM: its peak) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_child(path: str, quantize: str | None, context: int) -> None:
    """Runs in the child: load, a few decode steps, then print the resident memory in MiB as JSON."""
    loaded = status_mib("VmRSS")
    step = kettle_decode(load_model(path, torch.float32, torch.device("cpu"), quantize=quantize), 1, context, 8)
    for _ in range(4):
        step()
    print(json.dumps({"before_load": loaded, "serving": status_mib("VmRSS"), "peak": status_mib("VmHWM")}))


def memory(args: argparse.Namespace) -> None:
    """Each scheme in a fresh process. The peak includes the checkpoint file's pages while it is read
    (safetensors maps it), so "serving" (resident after load and decode) is what the scheme itself changes."""
    for quantize in (None, "int8", "int4"):
        command = [sys.executable, __file__, args.path, "--rss-child", quantize or "none", "--context", "32"]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        mib = json.loads(out.strip().splitlines()[-1])
        print(
            f"RSS {quantize or 'fp32':5s}: serving {mib['serving']:7.1f} MiB, peak {mib['peak']:7.1f} MiB "
            f"(runtime before loading: {mib['before_load']:.1f} MiB)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="a model folder (config.json + safetensors)")
    parser.add_argument("--context", type=int, default=16, help="prompt tokens before the timed steps")
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--memory", action="store_true", help="also report each scheme's peak RSS")
    parser.add_argument("--no-decode", action="store_true", help="skip the decode timing")
    parser.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rss_child:
        rss_child(args.path, None if args.rss_child == "none" else args.rss_child, args.context)
        return
    if not args.no_decode:
        decode(args)
    if args.memory:
        memory(args)


if __name__ == "__main__":
    main()
