"""Dense linear layers loaded from checkpoints, with projections fused at load time.

Projections that read the same input (q/k/v, gate/up) are concatenated row-wise once when loading, so each
is one matmul per step instead of two or three; the output is split with views. Quantized and
tensor-parallel variants replace `Linear` with the same call shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kettle import settings
from kettle.tensors.weights import Weights

# The batch size oneDNN lays packed weights out for; any number of rows works with them.
_PACK_ROWS = 16

# oneDNN keeps state per distinct input row count that it never frees: with the row counts of real traffic
# (every prefill length) a shard's memory grew by ~70 MB per 40 varied batches on the tiny test model, without
# bound. Rounding row counts above _PACK_ROWS up to a multiple of 32 (≤ 256 rows) or 64 bounds the shapes it
# ever sees (~80 up to a 4k-token prefill), and memory stays flat; decodes (≤ 16 rows) run unpadded.


def row_bucket(rows: int) -> int:
    """The padded row count a oneDNN linear runs `rows` rows at."""
    if rows <= _PACK_ROWS:
        return rows
    step = 32 if rows <= 256 else 64
    return -(-rows // step) * step


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [T, K] with zero rows appended up to `rows`. One pass over x: F.pad zero-fills its whole output first,
    then copies x in (two passes over a prompt chunk's activations, before every projection)."""
    out = x.new_empty(rows, x.shape[1])
    out[: x.shape[0]].copy_(x)
    out[x.shape[0] :].zero_()
    return out


def cpu_layout(weight: torch.Tensor) -> str:
    """How a weight is stored for its matmul: "onednn" (packed), "transposed" ([in, out]) or "dense" ([out, in]).

    Measured on this CPU (AVX2, 2 cores, SmolLM2-135M shapes, float32): oneDNN's packed weights run the
    LM head 3.4x and gate/up 1.7x faster than MKL at 16 rows and the same at 1 row; without oneDNN, x @ W with
    W stored [in, out] beats F.linear by 25–35% at 1 row. bfloat16 is ~5x slower transposed, and CUDA's GEMMs
    want the checkpoint layout. `KETTLE_TUNING=cpu-linear=onednn|transposed|dense` picks one (the off switch).
    """
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return "dense"
    choice = settings.current().cpu_linear
    if choice == "onednn" and not torch.backends.mkldnn.is_available():
        return "transposed"
    return choice


class Linear(nn.Module):
    """y = x Wᵀ (+ b) for x [T, in_features], W given as [out_features, in_features] (the checkpoint layout)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.layout = cpu_layout(weight)
        self.out_features = int(weight.shape[0])
        if self.layout == "onednn":
            stored = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS)
        else:
            stored = weight.t().contiguous() if self.layout == "transposed" else weight
        self.weight = nn.Parameter(stored, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def dense_weight(self) -> torch.Tensor:
        """W as [out_features, in_features] (a view when stored transposed), e.g. to share with an embedding."""
        if self.layout == "onednn":
            raise ValueError("a oneDNN-packed weight has no dense view")
        return self.weight.t() if self.layout == "transposed" else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "onednn":
            rows = x.shape[0]
            padded = row_bucket(rows)
            if padded != rows:
                x = pad_rows(x, padded)
            out = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
            return out if padded == rows else out[:rows]
        if self.layout == "dense":
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight)
        return torch.addmm(self.bias, x, self.weight)

    @classmethod
    def load(cls, weights: Weights, prefixes: list[str]) -> nn.Module:
        """The projections named by `prefixes` ("<prefix>.weight", optional "<prefix>.bias"), fused in order.

        When the checkpoint is read under a quantization scheme (`weights.quantize`) this is what the scheme
        loads instead (an int8/int4 linear with the same call shape), quantized as it is read or built from
        GPTQ/AWQ tensors.
        """
        quantized = weights.quantize.load_linear(weights, prefixes) if weights.quantize is not None else None
        if quantized is not None:
            return quantized
        parts = [weights.get(f"{prefix}.weight") for prefix in prefixes]
        biases = [weights.get_optional(f"{prefix}.bias") for prefix in prefixes]
        return cls(torch.cat(parts) if len(parts) > 1 else parts[0], fuse_biases(biases, parts))

    @classmethod
    def from_tensor(cls, weights: Weights, weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
        """A projection from a tensor the loader reshaped (per-head q/k/v regrouped, a Conv1D transposed),
        quantized under the load's scheme as `load` would quantize a stored one."""
        quantized = weights.quantize.quantize_tensor(weight, bias) if weights.quantize is not None else None
        return cls(weight, bias) if quantized is None else quantized


def fuse_biases(biases: list[torch.Tensor | None], weights: list[torch.Tensor]) -> torch.Tensor | None:
    """The concatenated biases; None when no projection has one, zeros for a projection without one."""
    if all(bias is None for bias in biases):
        return None
    filled = [
        bias if bias is not None else weight.new_zeros(weight.shape[0])
        for bias, weight in zip(biases, weights, strict=True)
    ]
    return torch.cat(filled)
