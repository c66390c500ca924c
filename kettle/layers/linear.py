"""Dense linear layers loaded from checkpoints, with projections fused at load time.

Projections that read the same input (q/k/v, gate/up) are concatenated row-wise once when loading, so each
is one matmul per step instead of two or three; the output is split with views. Quantized and
tensor-parallel variants replace `Linear` with the same call shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kettle.models.weights import Weights


def keeps_transposed(weight: torch.Tensor) -> bool:
    """Whether to store W as [in, out] and compute x @ W instead of F.linear's x @ Wᵀ.

    Measured on CPU (MKL, AVX2, SmolLM2-135M shapes): float32 x @ W is 25–35% faster at batch 1 and ~12%
    at batch 16, while bfloat16 is ~5x slower that way; CUDA's GEMMs want the checkpoint layout. So only
    float32 weights on the CPU are transposed, once, at load time.
    """
    return weight.device.type == "cpu" and weight.dtype == torch.float32


class Linear(nn.Module):
    """y = x Wᵀ (+ b) for x [T, in_features], W given as [out_features, in_features] (the checkpoint layout)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.transposed = keeps_transposed(weight)
        stored = weight.t().contiguous() if self.transposed else weight
        self.weight = nn.Parameter(stored, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def dense_weight(self) -> torch.Tensor:
        """W as [out_features, in_features] (a view when stored transposed), e.g. to share with an embedding."""
        return self.weight.t() if self.transposed else self.weight

    @property
    def out_features(self) -> int:
        return int(self.dense_weight.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.transposed:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight)
        return torch.addmm(self.bias, x, self.weight)

    @classmethod
    def load(cls, weights: Weights, prefixes: list[str]) -> Linear:
        """The projections named by `prefixes` ("<prefix>.weight", optional "<prefix>.bias"), fused in order."""
        parts = [weights.get(f"{prefix}.weight") for prefix in prefixes]
        biases = [weights.get_optional(f"{prefix}.bias") for prefix in prefixes]
        return cls(torch.cat(parts) if len(parts) > 1 else parts[0], fuse_biases(biases, parts))


def fuse_biases(biases: list[torch.Tensor | None], weights: list[torch.Tensor]) -> torch.Tensor | None:
    """The concatenated biases; None when no projection has one, zeros for a projection without one."""
    if all(bias is None for bias in biases):
        return None
    filled = [
        bias if bias is not None else weight.new_zeros(weight.shape[0])
        for bias, weight in zip(biases, weights, strict=True)
    ]
    return torch.cat(filled)
