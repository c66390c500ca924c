"""Loading helpers and MLPs shared by every native family.

- `checkpoint_prefix`: the same architecture is saved with or without its base-model prefix ("transformer.",
  "model.decoder." ...) depending on which class wrote it; loaders probe once instead of guessing.
- `load_grouped_qkv` / `load_per_head_qkv`: fused q/k/v stored grouped per KV head ([kv, G q heads + k + v,
  head_dim] rows: Falcon), or interleaved per head ([heads, 3, head_dim]: BLOOM, GPT-NeoX, GPT-BigCode without
  multi-query), reordered once at load into [q heads | k heads | v heads], so the attention splits them with
  views like every other family.
- `load_attention_projections`, `load_layer_norm`, `rms_norm_loader`: separate q/k/v fused into one Linear
  and the output projection; a LayerNorm with an optional bias; RMSNorms by name.
- `DenseMLP`: proj(act(fc(x))); `GatedMLP`: down(act(gate(x)) * up(x)).
Under tensor parallelism the projection loaders here read this rank's slice (kettle/layers/parallel.py): q/k/v
and fc/gate/up column-parallel, the output projections row-parallel; norms are replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from kettle.kernels import ops
from kettle.layers.activation import activation
from kettle.layers.backend import Backend, choose
from kettle.layers.cuda_fused import silu_mul, unit_stride
from kettle.layers.linear import Linear
from kettle.layers.norm import LayerNorm, RMSNorm
from kettle.layers.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    attention_columns,
    grouped_qkv_rows,
    query_columns,
    read_rows,
)
from kettle.tensors.weights import Weights


def checkpoint_prefix(weights: Weights, name: str, prefixes: Sequence[str]) -> str:
    """The first of `prefixes` under which the checkpoint holds `name` (checkpoints saved with or without a
    model prefix, e.g. "transformer.")."""
    for prefix in prefixes:
        if weights.has(f"{prefix}{name}"):
            return prefix
    raise KeyError(f"tensor {name!r} is not in the checkpoint at {weights.folder} under any of {list(prefixes)}")


def load_grouped_qkv(weights: Weights, prefix: str, num_heads: int, num_kv_heads: int, head_dim: int) -> Linear:
    """A fused query_key_value stored grouped per KV head, as one Linear producing [q | k | v]; under tensor
    parallelism a rank reads the block of rows of its KV groups and keeps its heads (`grouped_qkv_rows`)."""
    block, order = grouped_qkv_rows(num_heads, num_kv_heads, head_dim, weights.tp)
    order = order.to(weights.device)
    weight = read_rows(weights, f"{prefix}.weight", block)[order]
    bias = read_rows(weights, f"{prefix}.bias", block)[order] if weights.has(f"{prefix}.bias") else None
    return Linear.from_tensor(weights, weight, bias)  # quantized under the load's scheme, as `Linear.load` does


def load_per_head_qkv(weights: Weights, prefix: str, num_heads: int) -> Linear:
    """A fused query_key_value stored interleaved per head (multi-head attention: a group per head)."""
    head_dim = weights.shape(f"{prefix}.weight")[0] // (3 * num_heads)
    return load_grouped_qkv(weights, prefix, num_heads, num_heads, head_dim)


def load_per_head_attention(
    weights: Weights, qkv: str, out: str, num_heads: int, head_dim: int
) -> tuple[nn.Module, nn.Module]:
    """(`load_per_head_qkv` of `qkv`, the output projection `out`): a rank's heads and the matching columns."""
    columns = attention_columns(weights.tp, num_heads, num_heads, head_dim)
    return load_per_head_qkv(weights, qkv, num_heads), RowParallelLinear.load(weights, out, columns)


def load_attention_projections(
    weights: Weights, prefix: str, head_dim: int, names: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj")
) -> tuple[nn.Module, nn.Module]:
    """(q/k/v fused into one Linear, the output projection), named `names` under `prefix` (optional biases).
    Under tensor parallelism q/k/v hold this rank's heads and the output projection the matching columns."""
    qkv = [f"{prefix}.{name}" for name in names[:3]]
    out = RowParallelLinear.load(weights, f"{prefix}.{names[3]}", query_columns(weights, qkv, head_dim))
    return ColumnParallelLinear.load_qkv(weights, qkv, head_dim), out


def load_layer_norm(weights: Weights, prefix: str, eps: float) -> LayerNorm:
    """`<prefix>.weight` and, when the checkpoint has it, `<prefix>.bias`."""
    return LayerNorm(weights.get(f"{prefix}.weight"), weights.get_optional(f"{prefix}.bias"), eps)


def rms_norm_loader(weights: Weights, eps: float) -> Callable[[str], RMSNorm]:
    """name → the RMSNorm stored at `<name>.weight` (the norm loader `DecoderLM.llama_block` takes)."""
    return lambda name: RMSNorm(weights.get(f"{name}.weight"), eps)


class DenseMLP(nn.Module):
    """proj(act(fc(x))): the two-layer MLP of GPT-2-style blocks (biases as the checkpoint has them)."""

    def __init__(self, fc: Linear, proj: Linear, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fc, self.proj, self.act = fc, proj, act

    @classmethod
    def load(cls, weights: Weights, fc: str, proj: str, hidden_act: str) -> DenseMLP:
        """From the projections named `fc` and `proj` and a transformers activation name (fc column-parallel,
        proj row-parallel under tensor parallelism)."""
        fc_layer, proj_layer = ColumnParallelLinear.load(weights, [fc]), RowParallelLinear.load(weights, proj)
        return cls(fc_layer, proj_layer, activation(hidden_act))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) from one fused gate_up projection (SiLU: Llama, Mixtral experts, Phi-3; tanh-GELU:
    Gemma, Gemma 2)."""

    def __init__(self, gate_up: Linear, down: Linear, hidden_act: str) -> None:
        super().__init__()
        self.gate_up, self.down = gate_up, down
        self.act = activation(hidden_act)
        self.silu = hidden_act in ("silu", "swish")
        # The tanh approximation of GELU (Gemma's gate), which Kettle's CPU kernels compute too.
        self.gelu_tanh = self.act is activation("gelu_pytorch_tanh")
        self.backend: Backend | None = None  # chosen from the first input (quantized projections hide the dtype)

    @classmethod
    def load(
        cls, weights: Weights, prefix: str, hidden_act: str, names=("gate_proj", "up_proj", "down_proj"), reduce=True
    ) -> GatedMLP:
        """From separate gate/up projections (fused here) and a down projection under `prefix`; under tensor
        parallelism gate/up hold this rank's rows and down the matching columns. `reduce=False` leaves down's
        output this rank's partial sum (a mixture of experts reduces the sum of its experts once)."""
        gate, up, down = (f"{prefix}.{name}" for name in names)
        gate_up = ColumnParallelLinear.load(weights, [gate, up])
        down_layer = RowParallelLinear.load(weights, down) if reduce else RowParallelLinear.load_partial(weights, down)
        return cls(gate_up, down_layer, hidden_act)

    @classmethod
    def load_fused(cls, weights: Weights, gate_up: str, down: str, hidden_act: str) -> GatedMLP:
        """From a checkpoint whose gate and up are one stacked tensor (Phi-3's gate_up_proj)."""
        gate_up_layer = ColumnParallelLinear.load_stacked(weights, gate_up, parts=2)
        return cls(gate_up_layer, RowParallelLinear.load(weights, down), hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if self.backend is None:  # chosen once, from the first activations
            self.backend = choose(gate_up)
        backend = self.backend
        if self.silu and backend is Backend.TRITON and unit_stride(gate_up):
            return self.down(silu_mul(gate_up))  # one kernel on CUDA (off: KETTLE_TUNING=cuda-fused-kernels=off)
        if self.silu and backend is Backend.C:
            return self.down(ops.silu_mul(gate_up))  # one C call on the CPU (off: KETTLE_TUNING=cpu-kernels=off)
        if self.gelu_tanh and backend is Backend.C:
            return self.down(ops.gelu_tanh_mul(gate_up))  # the same for the tanh-GELU gate
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(self.act(gate) * up)
