"""ctypes bindings of the fused CPU decode step (decoder_step.c): the C description of a model and the call.

The description holds raw pointers into the model's tensors; kettle/models/decoder_step.py fills it from a
loaded model and keeps the model alive while the description is used.
"""

from __future__ import annotations

import ctypes

import torch

from kettle.kernels.build import library

LINEAR_Q4, LINEAR_Q8, LINEAR_F32 = 1, 2, 3
ACT_SILU, ACT_GELU_TANH = 0, 1  # the MLP gate's activation
_int, _ptr = ctypes.c_int64, ctypes.c_void_p


class Linear(ctypes.Structure):
    """One projection: kind (LINEAR_Q4/Q8/F32), the int4 group (else K), shape [n, k], weight pointers."""

    _fields_ = [("kind", _int), ("group", _int), ("n", _int), ("k", _int)]
    _fields_ += [("weight", _ptr), ("scales", _ptr), ("mins", _ptr), ("bias", _ptr)]


class Layer(ctypes.Structure):
    """One pre-norm layer: its two RMSNorm weights, four projections, sliding window (0: none) and per-head
    q/k RMSNorm weights (None: no q/k norms)."""

    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr)]
    _fields_ += [(name, Linear) for name in ("qkv", "o", "gate_up", "down")] + [("window", _int)]
    _fields_ += [("q_norm", _ptr), ("k_norm", _ptr)]


class Decoder(ctypes.Structure):
    """The whole stack: shapes, the float32-tile thresholds, the norm epsilon and attention scale, the layers."""

    _fields_ = [(name, _int) for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "inner")]
    _fields_ += [("block_size", _int), ("float_rows_q4", _int), ("float_rows_q8", _int)]
    _fields_ += [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
    _fields_ += [("layers", ctypes.POINTER(Layer)), ("final_norm", _ptr), ("act", _int)]


def run(
    decoder: Decoder,
    k_caches: ctypes.Array,
    v_caches: ctypes.Array,
    embedded: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    block_ids: torch.Tensor,
    max_blocks: int,
    positions: torch.Tensor,
) -> torch.Tensor:
    """embedded [S, hidden] float32 → the final norm's output [S, hidden]; writes the step's K/V at `slots`.
    `block_ids` [S * max_blocks] are the block tables (int64), `positions` [S] each row's position."""
    embedded, cos, sin = embedded.contiguous(), cos.contiguous(), sin.contiguous()
    out = torch.empty_like(embedded)
    status = library().kettle_decoder_step(
        ctypes.byref(decoder), k_caches, v_caches, embedded.data_ptr(), embedded.shape[0], cos.data_ptr(),
        sin.data_ptr(), slots.data_ptr(), block_ids.data_ptr(), max_blocks, positions.data_ptr(), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise MemoryError("CPU decoder step: out of memory for the step's activations")
    return out
