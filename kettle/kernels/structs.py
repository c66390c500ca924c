"""The C kernels' shared structs (kettle/kernels/kernels.h) as ctypes, and the order of their weight-type table.

One description: `Linear`, `Tuning` and `Attention` mirror kernels.h field by field, `WEIGHT_TYPES` the `LINEAR_*`
enum (weight_types.c's table rows), `PATHS` the `PATH_*` enum; tests/unit/test_weight_types.py reads kernels.h and
holds these to it. A quantized projection describes itself with a `Linear` (kettle/quantization/kernel_weight.py).
"""

from __future__ import annotations

import ctypes

_int, _ptr = ctypes.c_int64, ctypes.c_void_p

# kernels.h's LINEAR_* in order (0 unused): the rows layouts, float32, then the lanes layouts of the same bits.
WEIGHT_TYPES = (None, "q4", "q8", "f32", "q8_0", "q4_lanes", "q8_0_lanes", "q6_k_lanes", "q5_lanes", "iq4_xs_lanes")
LINEAR_Q4, LINEAR_Q8, LINEAR_F32, LINEAR_Q8G, LINEAR_Q4L, LINEAR_Q8L, LINEAR_Q6L, LINEAR_Q5L, LINEAR_IQ4L = range(1, 10)
LANES_TYPES = frozenset({LINEAR_Q4L, LINEAR_Q8L, LINEAR_Q6L, LINEAR_Q5L, LINEAR_IQ4L})
# The lanes types with AVX2 tiles too (weight_types.c's `quantized_rows_avx2`) and AVX2 integer panels (its
# `avx2_panels`): held in lanes on any AVX2 CPU (all of them).
AVX2_LANES_TYPES = frozenset({LINEAR_Q4L, LINEAR_Q8L, LINEAR_IQ4L, LINEAR_Q6L, LINEAR_Q5L})

# kernels.h's PATH_*: how one projection multiplies (linear.c `choose_path` picks one per call).
PATHS = ("plain", "tiles", "quantized", "invariant", "gemm", "int_gemm")
PATH_PLAIN, PATH_TILES, PATH_QUANTIZED, PATH_INVARIANT, PATH_GEMM, PATH_INT_GEMM = range(6)
# What `kettle_linear` takes instead of a path: the chooser's pick for decode rows, or for prompt rows.
PATH_DECODE_ROWS, PATH_PROMPT_ROWS = -1, -2

# cpu_kernels.c's `kettle_rows` ops.
ROWS_RMS_NORM, ROWS_SILU_MUL, ROWS_GELU_TANH_MUL, ROWS_ROPE, ROWS_GREEDY = range(5)


class Linear(ctypes.Structure):
    """One projection: its weight type (`LINEAR_*`), the int4 group (Q8_0: 32, else K), shape [n, k], and the
    pointers of its tensors as kernels.h lays them out (`supers`: a Q4 weight's Q4_K super-block scales in lanes or a
    Q6_K weight's d, else None); `next`: the next part of a projection stacked along its outputs, or NULL."""


Linear._fields_ = [
    *[("kind", _int), ("group", _int), ("n", _int), ("k", _int)],
    *[("weight", _ptr), ("scales", _ptr), ("mins", _ptr), ("bias", _ptr), ("supers", _ptr)],
    ("next", ctypes.POINTER(Linear)),
]


def outputs(weight: Linear) -> int:
    """A projection's output channels, every stacked part's."""
    n, part = weight.n, weight.next
    while part:
        n, part = n + part.contents.n, part.contents.next
    return n


class Tuning(ctypes.Structure):
    """The measurement switches the path chooser reads (kettle/settings.py's tuning; -1: the kernels' defaults)."""

    _fields_ = [(name, _int) for name in ("quantized_activations", "invariant", "integer_gemm")]
    _fields_ += [("float_rows", _int), ("gemm_rows", _int)]


class Attention(ctypes.Structure):
    """One attention call over the paged cache: decode (prefill 0) or one sequence's prefill (prefill 1)."""

    _fields_ = [("prefill", _int), ("q", _ptr), ("ldq", _int), ("k_cache", _ptr), ("v_cache", _ptr)]
    _fields_ += [("tables", _ptr), ("max_blocks", _int), ("positions", _ptr)]
    _fields_ += [(name, _int) for name in ("rows", "cache_len", "heads", "kv_heads", "dim", "block_size", "window")]
    _fields_ += [("scale", ctypes.c_float), ("kv_dtype", _int), ("per_sequence", _int), ("out", _ptr)]
