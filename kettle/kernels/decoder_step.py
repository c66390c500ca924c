"""ctypes bindings of the fused CPU decode step (decoder_step.c): the C description of a model and the call.

The description holds raw pointers into the model's tensors; kettle/models/decoder_step.py fills it from a
loaded model and keeps the model alive while the description is used.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kettle.kernels.build import library
from kettle.kernels.structs import Linear, Tuning

NORM_NONE, NORM_RMS, NORM_LAYER = 0, 1, 2
ACT_SILU, ACT_GELU_TANH, ACT_GELU, ACT_RELU = 0, 1, 2, 3  # the MLP's activation (of the gate when gated)
MAX_EXPERTS = 64
_int, _ptr, _float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class Norm(ctypes.Structure):
    """One norm: kind (NORM_NONE/RMS/LAYER), weight and bias pointers (bias: LayerNorm's or None), epsilon."""

    _fields_ = [("kind", _int), ("weight", _ptr), ("bias", _ptr), ("eps", _float)]


class Experts(ctypes.Structure):
    """A top-k mixture: the float32 router [E, hidden] and one gated projection pair per expert."""

    _fields_ = [("num_experts", _int), ("top_k", _int), ("router", _ptr)]
    _fields_ += [("up", ctypes.POINTER(Linear)), ("down", ctypes.POINTER(Linear))]


class Layer(ctypes.Structure):
    """One block: its norms (NORM_NONE where absent), four projections, sliding window (0: none), residual
    shape (parallel or not), MLP kind and activation, the step's RoPE table it rotates with (an index), attention
    scale and soft-cap (0: none), experts or None."""

    _fields_ = [(name, Norm) for name in ("input_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm")]
    _fields_ += [("q_norm", Norm), ("k_norm", Norm)]
    _fields_ += [(name, Linear) for name in ("qkv", "o", "up", "down")]
    _fields_ += [(name, _int) for name in ("window", "parallel", "gated", "act", "rope_table")]
    _fields_ += [("scale", _float), ("softcap", _float), ("experts", ctypes.POINTER(Experts))]


class Lora(ctypes.Structure):
    """One projection's stacked LoRA matrices for a step (rank 0: none): A [R, K], B [R, N] (scales folded in),
    the mask [adapters + 1, R] and each stacked row's output columns."""

    _fields_ = [("rank", _int), ("a", _ptr), ("b", _ptr), ("mask", _ptr), ("cols", _ptr), ("widths", _ptr)]


LORA_PER_LAYER = 4  # qkv, o, gate_up (or fc), down: the order of a layer's entries in the step's Lora array


class Decoder(ctypes.Structure):
    """The whole stack: shapes, the rotary layout and the number of RoPE tables a step passes, the layers, the final
    norm, the KV cache's element type (ops.KV_DTYPES) and the path chooser's tuning (ops.tuning), the last two set
    per step."""

    _fields_ = [(name, _int) for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "inner")]
    _fields_ += [("block_size", _int), ("rot_dim", _int), ("interleaved", _int), ("rope_tables", _int)]
    _fields_ += [("layers", ctypes.POINTER(Layer)), ("final_norm", Norm), ("kv_dtype", _int), ("tuning", Tuning)]


@dataclass
class StepRows:
    """Where a step's rows go: cos/sin [tables, rows, rot_dim], every RoPE table's rows (None without RoPE), each
    row's cache slot and position (int64), and the block tables `block_ids` [S · max_blocks] (int64) of its S
    sequences. A greedy window's rows are its steps' rows one step after another (`run_greedy`): cos/sin
    [steps, tables, S, rot_dim]."""

    cos: torch.Tensor | None
    sin: torch.Tensor | None
    slots: torch.Tensor
    block_ids: torch.Tensor
    max_blocks: int
    positions: torch.Tensor

    def __post_init__(self) -> None:
        if self.cos is not None:  # the C step reads rot_dim floats per row, one table's rows after another
            self.cos, self.sin = self.cos.contiguous(), self.sin.contiguous()

    def pointers(self) -> tuple:
        """cos, sin, slots, tables, max_blocks, positions as the C entries take them."""
        rope = (None, None) if self.cos is None else (self.cos.data_ptr(), self.sin.data_ptr())
        return *rope, self.slots.data_ptr(), self.block_ids.data_ptr(), self.max_blocks, self.positions.data_ptr()


def run(
    decoder: Decoder,
    caches: tuple[ctypes.Array, ctypes.Array],
    embedded: torch.Tensor,
    rows: StepRows,
    loras: ctypes.Array | None = None,
    lora_slot: torch.Tensor | None = None,
) -> torch.Tensor:
    """embedded [S, hidden] float32 → the final norm's output [S, hidden]; writes the step's K/V (`caches`: the
    per-layer K and V pointers) at the rows' slots. `loras` [layers · LORA_PER_LAYER] and `lora_slot` [S]
    (int64) when the step has adapter rows."""
    embedded = embedded.contiguous()
    out = torch.empty_like(embedded)
    cos, sin, slots, tables, max_blocks, positions = rows.pointers()
    status = library().kettle_decoder_step(
        ctypes.byref(decoder), *caches, embedded.data_ptr(), embedded.shape[0], cos, sin, slots, tables, max_blocks,
        positions, out.data_ptr(), torch.get_num_threads(), loras, None if lora_slot is None else lora_slot.data_ptr(),
    )  # fmt: skip
    if status:
        raise MemoryError("CPU decoder step: out of memory for the step's activations")
    return out


def run_greedy(
    decoder: Decoder,
    caches: tuple[ctypes.Array, ctypes.Array],
    ends: tuple[Linear, Linear],
    tokens: torch.Tensor,
    rows: StepRows,
    stop_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decode steps of `tokens` [S] (each sequence's last token, int64) in one call, through the embedding
    and the LM head of `ends` (the head on the path linear.c picks for it): step s takes rows s·S .. s·S + S of
    `rows`. Returns the chosen ids [n, S] (int64) and their logprobs [n, S] for the n steps run: all of them, or
    fewer when a step chose one of `stop_ids` (int64)."""
    seqs = tokens.shape[0]
    steps = rows.positions.shape[0] // seqs
    tokens = tokens.clone()  # the C loop feeds each step's choice back through it
    ids = torch.empty(steps, seqs, dtype=torch.long)
    logprobs = torch.empty(steps, seqs, dtype=torch.float32)
    embedding, head = ends
    done = library().kettle_greedy_steps(
        ctypes.byref(decoder), *caches, ctypes.byref(embedding), ctypes.byref(head), tokens.data_ptr(),
        seqs, steps, *rows.pointers(), stop_ids.data_ptr(), stop_ids.numel(), ids.data_ptr(), logprobs.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if done < 0:
        raise MemoryError("CPU greedy steps: out of memory for the step's activations")
    return ids[:done], logprobs[:done]
