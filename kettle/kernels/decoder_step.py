"""ctypes bindings of the fused CPU decode step (decoder_step.c): the C description of a model and the call.

The description holds raw pointers into the model's tensors; kettle/models/decoder_step.py fills it from a
loaded model and keeps the model alive while the description is used.
"""

from __future__ import annotations

import ctypes

import torch

from kettle.kernels.build import library

LINEAR_Q4, LINEAR_Q8, LINEAR_F32, LINEAR_Q8G = 1, 2, 3, 4
NORM_NONE, NORM_RMS, NORM_LAYER = 0, 1, 2
ACT_SILU, ACT_GELU_TANH, ACT_GELU, ACT_RELU = 0, 1, 2, 3  # the MLP's activation (of the gate when gated)
MAX_EXPERTS = 64
_int, _ptr, _float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class Linear(ctypes.Structure):
    """One projection: kind (LINEAR_Q4/Q8/F32/Q8G), the int4 group (Q8G: 32, else K), shape [n, k], weight
    pointers."""

    _fields_ = [("kind", _int), ("group", _int), ("n", _int), ("k", _int)]
    _fields_ += [("weight", _ptr), ("scales", _ptr), ("mins", _ptr), ("bias", _ptr)]


class Norm(ctypes.Structure):
    """One norm: kind (NORM_NONE/RMS/LAYER), weight and bias pointers (bias: LayerNorm's or None), epsilon."""

    _fields_ = [("kind", _int), ("weight", _ptr), ("bias", _ptr), ("eps", _float)]


class Experts(ctypes.Structure):
    """A top-k mixture: the float32 router [E, hidden] and one gated projection pair per expert."""

    _fields_ = [("num_experts", _int), ("top_k", _int), ("router", _ptr)]
    _fields_ += [("up", ctypes.POINTER(Linear)), ("down", ctypes.POINTER(Linear))]


class Layer(ctypes.Structure):
    """One block: its norms (NORM_NONE where absent), four projections, sliding window (0: none), residual
    shape (parallel or not), MLP kind and activation, attention scale and soft-cap (0: none), experts or None."""

    _fields_ = [(name, Norm) for name in ("input_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm")]
    _fields_ += [("q_norm", Norm), ("k_norm", Norm)]
    _fields_ += [(name, Linear) for name in ("qkv", "o", "up", "down")]
    _fields_ += [(name, _int) for name in ("window", "parallel", "gated", "act")]
    _fields_ += [("scale", _float), ("softcap", _float), ("experts", ctypes.POINTER(Experts))]


class Lora(ctypes.Structure):
    """One projection's stacked LoRA matrices for a step (rank 0: none): A [R, K], B [R, N] (scales folded in),
    the mask [adapters + 1, R] and each stacked row's output columns."""

    _fields_ = [("rank", _int), ("a", _ptr), ("b", _ptr), ("mask", _ptr), ("cols", _ptr), ("widths", _ptr)]


LORA_PER_LAYER = 4  # qkv, o, gate_up (or fc), down: the order of a layer's entries in the step's Lora array


class Decoder(ctypes.Structure):
    """The whole stack: shapes, the float32-tile thresholds, the rotary layout, the layers, the final norm and the
    KV cache's element type (ops.KV_DTYPES, set per step)."""

    _fields_ = [(name, _int) for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "inner")]
    _fields_ += [("block_size", _int), ("float_rows_q4", _int), ("float_rows_q8", _int), ("gemm_rows", _int)]
    _fields_ += [("integer_gemm", _int)]
    _fields_ += [("rot_dim", _int), ("interleaved", _int)]
    _fields_ += [("layers", ctypes.POINTER(Layer)), ("final_norm", Norm), ("kv_dtype", _int)]


def run(
    decoder: Decoder,
    k_caches: ctypes.Array,
    v_caches: ctypes.Array,
    embedded: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    slots: torch.Tensor,
    block_ids: torch.Tensor,
    max_blocks: int,
    positions: torch.Tensor,
    loras: ctypes.Array | None = None,
    lora_slot: torch.Tensor | None = None,
) -> torch.Tensor:
    """embedded [S, hidden] float32 → the final norm's output [S, hidden]; writes the step's K/V at `slots`.
    cos/sin [S, rot_dim] (None without RoPE), `block_ids` [S * max_blocks] the block tables (int64),
    `positions` [S] each row's position; `loras` [layers · LORA_PER_LAYER] and `lora_slot` [S] (int64) when
    the step has adapter rows."""
    embedded = embedded.contiguous()
    cos, sin = (None, None) if cos is None else (cos.contiguous(), sin.contiguous())
    out = torch.empty_like(embedded)
    status = library().kettle_decoder_step(
        ctypes.byref(decoder), k_caches, v_caches, embedded.data_ptr(), embedded.shape[0],
        None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(), slots.data_ptr(),
        block_ids.data_ptr(), max_blocks, positions.data_ptr(), out.data_ptr(), torch.get_num_threads(), loras,
        None if lora_slot is None else lora_slot.data_ptr(),
    )  # fmt: skip
    if status:
        raise MemoryError("CPU decoder step: out of memory for the step's activations")
    return out


def run_greedy(
    decoder: Decoder,
    k_caches: ctypes.Array,
    v_caches: ctypes.Array,
    embedding: Linear,
    head: Linear,
    head_path: int,
    tokens: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    slots: torch.Tensor,
    block_ids: torch.Tensor,
    max_blocks: int,
    positions: torch.Tensor,
    stop_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decode steps of `tokens` [S] (each sequence's last token, int64) in one call: step s reads rows
    s·S .. s·S + S of cos/sin [steps·S, rot_dim], slots and positions [steps·S]. Returns the chosen ids [n, S]
    (int64) and their logprobs [n, S] for the n steps run: all of them, or fewer when a step chose one of
    `stop_ids` (int64)."""
    rows = tokens.shape[0]
    steps = positions.shape[0] // rows
    tokens = tokens.clone()  # the C loop feeds each step's choice back through it
    cos, sin = (None, None) if cos is None else (cos.contiguous(), sin.contiguous())
    ids = torch.empty(steps, rows, dtype=torch.long)
    logprobs = torch.empty(steps, rows, dtype=torch.float32)
    done = library().kettle_greedy_steps(
        ctypes.byref(decoder), k_caches, v_caches, ctypes.byref(embedding), ctypes.byref(head), head_path,
        tokens.data_ptr(), rows, steps, None if cos is None else cos.data_ptr(),
        None if sin is None else sin.data_ptr(), slots.data_ptr(), block_ids.data_ptr(), max_blocks,
        positions.data_ptr(), stop_ids.data_ptr(), stop_ids.numel(), ids.data_ptr(), logprobs.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if done < 0:
        raise MemoryError("CPU greedy steps: out of memory for the step's activations")
    return ids[:done], logprobs[:done]
