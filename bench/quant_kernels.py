"""Micro-benchmark of the CPU weight-only kernels over SmolLM2-135M's matmul shapes.

For each layer shape (as Kettle runs it: q/k/v and gate/up fused) and each row count, times y = x Wᵀ with
fp32 oneDNN-packed weights (Kettle's dense path), int8 per-channel (`_weight_int8pack_mm`) and int4
group-wise (`_weight_int4pack_mm_for_cpu`), fp32 activations (and bf16 with --bf16), interleaved so that
all see the same machine load; prints median microseconds and the speed-up over fp32.

    .venv/bin/python bench/quant_kernels.py --threads 2 --rows 1 16 128
"""

from __future__ import annotations

import argparse
import time

import torch

from kettle.layers.linear import Linear
from kettle.quantization.int4 import Int4Linear
from kettle.quantization.int8 import Int8Linear

# (name, out_features, in_features) of SmolLM2-135M's matmuls, fused the way Kettle loads them.
SHAPES = [
    ("qkv", 960, 576),
    ("o_proj", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
    ("lm_head", 49152, 576),
]


def median_us(fns: list, steps: int) -> list[float]:
    """Best-of microseconds of each function, run interleaved after one warm-up call each (the minimum, not the
    median: on a shared CPU the median measures the neighbours)."""
    for fn in fns:
        fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(steps):
        for fn, times in zip(fns, samples, strict=True):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return [min(times) * 1e6 for times in samples]


Layers = dict[str, tuple[torch.nn.Module, torch.dtype]]


def layers_for(out_features: int, in_features: int, bf16: bool, dense: bool, fp32_kernels: bool) -> Layers:
    """The variants to time for one shape, each with the activation dtype it is fed."""
    weight = torch.randn(out_features, in_features) * 0.02
    layers = {"fp32": (Linear(weight.clone()), torch.float32)}
    if fp32_kernels:
        layers["int8"] = (Int8Linear.from_weight(weight), torch.float32)
        layers["int4"] = (Int4Linear.from_weight(weight), torch.float32)
    if bf16:
        layers["int8-bf16"] = (Int8Linear.from_weight(weight, act_dtype=torch.bfloat16), torch.bfloat16)
        layers["int4-bf16"] = (Int4Linear.from_weight(weight, act_dtype=torch.bfloat16), torch.bfloat16)
    if dense:
        # The same layers forced onto the dense path (weight dequantized per call, float32 GEMM).
        for kind, cls in (("int8", Int8Linear), ("int4", Int4Linear)):
            layer = cls.from_weight(weight)
            layer.dense_rows = 0
            layers[f"{kind}-dense"] = (layer, torch.float32)
    return layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--bf16", action="store_true", help="also time int4 with bfloat16 activations")
    parser.add_argument("--fp32-kernels", action="store_true", help="also time the packed kernels on float32")
    parser.add_argument("--dense", action="store_true", help="also time the dequantize-then-GEMM path")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads={args.threads}; best-of us per matmul (speed-up vs fp32 oneDNN)")
    for name, out_features, in_features in SHAPES:
        layers = layers_for(out_features, in_features, args.bf16, args.dense, args.fp32_kernels)
        for rows in args.rows:
            x = torch.randn(rows, in_features)
            inputs = [(layer, x.to(dt)) for layer, dt in layers.values()]
            fns = [(lambda layer=layer, xi=xi: layer(xi)) for layer, xi in inputs]
            with torch.inference_mode():
                times = median_us(fns, max(5, args.steps // max(1, rows // 16)))
            base = times[0]
            cells = "  ".join(f"{k}={t:8.1f} ({base / t:4.2f}x)" for k, t in zip(layers, times, strict=True))
            print(f"{name:8s} {out_features:5d}x{in_features:<5d} rows={rows:<4d} {cells}")


if __name__ == "__main__":
    main()
