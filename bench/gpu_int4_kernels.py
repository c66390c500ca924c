"""int4 on CUDA, kernel against kernel: Kettle's Triton kernel, PyTorch's tinygemm, and a dense bf16 GEMM over the
weight dequantized for the call, on Llama-2-7B's projections, against bf16 cuBLAS.

Method: two layers' worth of the four projections (qkv 12288x4096, o 4096x4096, gate_up 22016x4096, down
4096x11008; random weights quantized with groups of 128), so the int4 weights (~200 MB) do not fit the L2 cache
and every call streams them from memory. One timed call runs the eight projections in order; CUDA events over 30
calls after a warm-up (Triton's autotuning included), the median of 5 such runs. Achieved bandwidth = bytes of the
weights read (int4: packed values + bf16 scale/zero pairs) / time, against the device's copy bandwidth (read +
written, as bench/gpu_decode.py measures it). The relative error of each int4 path is taken against a float32
product with the same dequantized weights.

    PYTHONPATH=. python3 bench/gpu_int4_kernels.py --rows 1 8 16 32 64 128
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from gpu_measure import copy_bandwidth, event_per_call

from kettle.quantization.int4 import Int4Linear, quantize_int4

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
KERNELS = ("triton", "tinygemm", "dense")


def build(layers: int, group: int) -> tuple[list[torch.Tensor], dict[str, list[Int4Linear]]]:
    """bf16 weights and, per int4 kernel, the same weights quantized (the dense path reads the Triton layout)."""
    dense, quantized = [], {"triton": [], "tinygemm": []}
    for _ in range(layers):
        for n, k in SHAPES.values():
            weight = torch.randn(n, k, device="cuda") * 0.02
            dense.append(weight.bfloat16())
            q, scale, zero = quantize_int4(weight, group)
            for kernel, built in quantized.items():
                built.append(Int4Linear(q, scale, zero, group, cuda_kernel=kernel))
    return dense, quantized


def timed(fn, calls: int = 30, runs: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    return statistics.median(event_per_call(fn, calls) for _ in range(runs))


def relative_error(layer: Int4Linear, y: torch.Tensor, x: torch.Tensor) -> float:
    expected = F.linear(x.float(), layer.dequantized())
    return float((y.float() - expected).norm() / expected.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--group", type=int, default=128)
    args = parser.parse_args()
    copy_bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)", flush=True)
    dense, quantized = build(args.layers, args.group)
    int4_bytes = sum(t.numel() * t.element_size() for m in quantized["triton"] for t in (m.packed, m.scale_zero))
    bf16_bytes = sum(w.numel() * 2 for w in dense)
    print(f"weights read per call: bf16 {bf16_bytes / 1e6:.0f} MB, int4 {int4_bytes / 1e6:.0f} MB")
    print("rows | bf16 ms | triton ms | tinygemm ms | dense ms | triton %bw | bf16/triton | bf16/tinygemm | err triton")
    with torch.inference_mode():
        for rows in args.rows:
            xs = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for k in {k for _, k in SHAPES.values()}}
            ms = {"bf16": timed(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in dense])}
            for kernel in KERNELS:
                layers = quantized["tinygemm" if kernel == "tinygemm" else "triton"]
                for layer in layers:
                    layer.dense_rows = -1 if kernel == "dense" else 10**9
                ms[kernel] = timed(lambda layers=layers, xs=xs: [m(xs[m.in_features]) for m in layers])
            triton_layers = quantized["triton"]
            for layer in triton_layers:
                layer.dense_rows = 10**9
            error = max(relative_error(m, m(xs[m.in_features]), xs[m.in_features]) for m in triton_layers[:4])
            print(
                f"{rows:4d} | {ms['bf16'] * 1e3:7.3f} | {ms['triton'] * 1e3:9.3f} | {ms['tinygemm'] * 1e3:11.3f} | "
                f"{ms['dense'] * 1e3:8.3f} | {100 * int4_bytes / ms['triton'] / copy_bw:10.1f} | "
                f"{ms['bf16'] / ms['triton']:11.2f} | {ms['bf16'] / ms['tinygemm']:13.2f} | {error:.2e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
