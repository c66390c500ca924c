"""The `--quantize` values and their knobs: which ones run where, and the environment switches."""

from __future__ import annotations

import os

import torch

DEFAULT_INT4_GROUP_SIZE = 128
DEFAULT_LM_HEAD = "int8"  # int4 heads cost accuracy: see README (quantization)
# The packed kernels' activation dtype. Measured on this AVX2 CPU (bench/quant_kernels.py): with float32
# activations both kernels fall back to a path 4-50x slower than float32 oneDNN; with bfloat16 they beat it
# at 1-8 rows (int4 ~2x, int8 ~1.5x). Inputs are cast per call and outputs cast back to the model's dtype.
KERNEL_ACT_DTYPE = torch.bfloat16
# Above this many rows, a dense float32 GEMM on the weight dequantized for the call beats the packed kernels
# (measured ~0.4x of float32 at 256 rows, against 0.5-0.9x for dequantize + GEMM).
DEFAULT_DENSE_ROWS = 128


def int8_gemv_rows() -> int:
    """On CUDA, int8 calls with at most this many rows use the Triton GEMV that reads the int8 weight
    (`KETTLE_INT8_GEMV_ROWS`, default 64); more rows multiply a bf16 copy dequantized for the call."""
    return int(os.environ.get("KETTLE_INT8_GEMV_ROWS", "64"))


def int4_group_size() -> int | None:
    """`KETTLE_INT4_GROUP_SIZE` (32, 64, 128 or 256) for `--quantize int4`; unset: None, meaning 128 unless a
    weight already lies on a finer 4-bit grid (`kettle.quantization.int4.native_group_size`)."""
    value = os.environ.get("KETTLE_INT4_GROUP_SIZE")
    if value is None:
        return None
    if value not in ("32", "64", "128", "256"):
        raise ValueError(f"KETTLE_INT4_GROUP_SIZE must be 32, 64, 128 or 256, got {value!r}")
    return int(value)


def lm_head_scheme(method: str) -> str | None:
    """How `--quantize int8|int4` stores the LM head: `KETTLE_QUANT_LM_HEAD` = int8, int4, or dense (0)."""
    value = os.environ.get("KETTLE_QUANT_LM_HEAD", DEFAULT_LM_HEAD)
    if value not in ("int8", "int4", "dense", "0"):
        raise ValueError(f"KETTLE_QUANT_LM_HEAD must be int8, int4 or dense, got {value!r}")
    if value in ("dense", "0"):
        return None
    return "int8" if method == "int8" else value


def dense_rows_threshold() -> int:
    """Calls with more rows than this use a dense float32 GEMM on the dequantized weight instead of the packed
    kernel (`KETTLE_QUANT_DENSE_ROWS`, default 128; 0 turns the dense path off). On CUDA the same threshold
    sends int4 calls from tinygemm to a GEMM in the model dtype (not yet measured there)."""
    rows = int(os.environ.get("KETTLE_QUANT_DENSE_ROWS", str(DEFAULT_DENSE_ROWS)))
    return rows if rows > 0 else 1 << 62
