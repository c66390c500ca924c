"""The knobs of weight-only quantization: group size, LM head, activation dtype and row thresholds."""

from __future__ import annotations

import torch

from kettle import settings

DEFAULT_INT4_GROUP_SIZE = 128
# The packed kernels' activation dtype. Measured on this AVX2 CPU (`python -m bench decode --vs kernels`): with float32
# activations both kernels fall back to a path 4-50x slower than float32 oneDNN; with bfloat16 they beat it
# at 1-8 rows (int4 ~2x, int8 ~1.5x). Inputs are cast per call and outputs cast back to the model's dtype.
KERNEL_ACT_DTYPE = torch.bfloat16
# Above this many rows, a dense float32 GEMM on the weight dequantized for the call beats the packed kernels
# (measured ~0.4x of float32 at 256 rows, against 0.5-0.9x for dequantize + GEMM). On CUDA the same threshold
# sends int4 calls from tinygemm to a GEMM in the model dtype (not yet measured there).
DENSE_ROWS = 128
# On CUDA, int8 calls with at most this many rows use the Triton GEMV that reads the int8 weight; more rows
# multiply a bf16 copy dequantized for the call.
INT8_GEMV_ROWS = 64


def int4_group_size() -> int | None:
    """`KETTLE_INT4_GROUP_SIZE` (32, 64, 128 or 256) for `--quantize int4`; unset: None, meaning 128 unless a
    weight already lies on a finer 4-bit grid (`kettle.quantization.int4.native_group_size`)."""
    return settings.current().int4_group_size


def lm_head_scheme(method: str) -> str | None:
    """How `--quantize int8|int4` stores the LM head: `KETTLE_QUANT_LM_HEAD` = int8 (default), int4, or dense."""
    value = settings.current().quant_lm_head
    if value == "dense":
        return None
    return "int8" if method == "int8" else value
