"""Loading helpers and MLPs shared by every native family.

- `checkpoint_prefix`: the same architecture is saved with or without its base-model prefix ("transformer.",
  "model.decoder." ...) depending on which class wrote it; loaders probe once instead of guessing.
- `per_head_to_grouped` / `load_per_head_qkv`: fused q/k/v stored interleaved per head ([heads, 3, head_dim]
  rows: BLOOM, GPT-NeoX, Falcon without multi-query, GPT-BigCode without multi-query) reordered once at load
  into [q heads | k heads | v heads], so the attention splits them with views like every other family.
- `load_qkv`, `load_layer_norm`, `rms_norm_loader`: separate q/k/v fused into one Linear; a LayerNorm with an
  optional bias; RMSNorms by name.
- `DenseMLP`: proj(act(fc(x))); `GatedMLP`: down(act(gate(x)) * up(x)).
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
from kettle.layers.parallel import ColumnParallelLinear, RowParallelLinear
from kettle.tensors.weights import Weights


def checkpoint_prefix(weights: Weights, name: str, prefixes: Sequence[str]) -> str:
    """The first of `prefixes` under which the checkpoint holds `name` (checkpoints saved with or without a
    model prefix, e.g. "transformer.")."""
    for prefix in prefixes:
        if weights.has(f"{prefix}{name}"):
            return prefix
    raise KeyError(f"tensor {name!r} is not in the checkpoint at {weights.folder} under any of {list(prefixes)}")


def per_head_to_grouped(tensor: torch.Tensor, num_heads: int, parts: int = 3) -> torch.Tensor:
    """Rows laid out [heads, parts, head_dim] (weight [rows, in] or bias [rows]) → [parts, heads, head_dim]."""
    rest = tensor.shape[1:]
    head_dim = tensor.shape[0] // (num_heads * parts)
    grouped = tensor.view(num_heads, parts, head_dim, *rest).transpose(0, 1)
    return grouped.reshape(tensor.shape).contiguous()


def load_per_head_qkv(weights: Weights, prefix: str, num_heads: int) -> Linear:
    """A fused query_key_value projection stored per head, as one Linear producing [q | k | v]."""
    weight = per_head_to_grouped(weights.get(f"{prefix}.weight"), num_heads)
    bias = weights.get_optional(f"{prefix}.bias")
    return Linear.from_tensor(weights, weight, None if bias is None else per_head_to_grouped(bias, num_heads))


def load_qkv(weights: Weights, prefix: str, names: tuple[str, str, str] = ("q_proj", "k_proj", "v_proj")) -> Linear:
    """Separate q/k/v projections (optional biases) fused into one Linear."""
    return Linear.load(weights, [f"{prefix}.{name}" for name in names])


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
        """From the projections named `fc` and `proj` and a transformers activation name."""
        return cls(Linear.load(weights, [fc]), Linear.load(weights, [proj]), activation(hidden_act))

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
    def load(cls, weights: Weights, prefix: str, hidden_act: str, names=("gate_proj", "up_proj", "down_proj")):
        """From separate gate/up projections (fused here) and a down projection under `prefix`; under tensor
        parallelism gate/up hold this rank's rows and down the matching columns."""
        gate, up, down = (f"{prefix}.{name}" for name in names)
        gate_up = ColumnParallelLinear.load(weights, [gate, up])
        return cls(gate_up, RowParallelLinear.load(weights, down), hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        backend = self.backend = self.backend or choose(gate_up)
        if self.silu and backend is Backend.TRITON and unit_stride(gate_up):
            return self.down(silu_mul(gate_up))  # one kernel on CUDA (off: KETTLE_FUSED_KERNELS=0)
        if self.silu and backend is Backend.C:
            return self.down(ops.silu_mul(gate_up))  # one C call on the CPU (off: KETTLE_CPU_KERNELS=0)
        if self.gelu_tanh and backend is Backend.C:
            return self.down(ops.gelu_tanh_mul(gate_up))  # the same for the tanh-GELU gate
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(self.act(gate) * up)
