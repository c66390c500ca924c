"""The base of the projections Kettle's CPU kernels multiply: each describes its weight to C once per call as one of
kernels.h's weight types (`describe`), and the kernels do the rest for every type alike (kettle/kernels/linear.c
picks the path, weight_types.c holds what differs between types).
"""

from __future__ import annotations

import ctypes
import itertools
from typing import TYPE_CHECKING

import torch
from torch import nn

from kettle.kernels import ops
from kettle.kernels.structs import Linear

if TYPE_CHECKING:
    from kettle.tensors.gguf_file import Blocks


def pointer(tensor: torch.Tensor | None) -> int | None:
    """A tensor's address for a C description (None: NULL)."""
    return None if tensor is None else tensor.data_ptr()


class KernelWeight(nn.Module):
    """A projection y = x Wᵀ (+ b) whose weight the CPU kernels read in place: subclasses hold the tensors in their
    type's layout and say where they are (`describe`); the forward, the dense weight and an embedding lookup are the
    same calls for every type."""

    in_features: int
    out_features: int
    bias: nn.Parameter | None

    def describe(self) -> Linear:
        """The weight as kernels.h's `Linear` (its type, group, shape and tensor addresses)."""
        raise NotImplementedError

    def kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        """y = x Wᵀ (+ b) on the kernels, any leading shape, in x's dtype."""
        rows = x.reshape(-1, self.in_features)
        y = ops.linear(rows.float(), self.describe())
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def kernel_dequantized(self) -> torch.Tensor:
        """W as a dense float32 [out, in] tensor, exactly what the kernels multiply by (one parallel C pass)."""
        return ops.dequantize(self.describe())

    def kernel_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W in float32, the values the kernels multiply by: the embedding lookup of a quantized table
        (tied to the head or its own), which then needs no float32 copy."""
        return ops.dequantize(self.describe(), ids).view(*ids.shape, self.in_features)

    def rows_of(self, first: int, count: int) -> Linear:
        """Output channels first .. first + count - 1 as a weight of their own, without bias (a type packed from GGUF
        blocks says where its rows are)."""
        raise NotImplementedError

    def pack_parts(self, parts: list[Blocks]) -> None:
        """The weight's tensors (allocated in its layout) filled from GGUF tensors' blocks by the kernels, each part
        into its rows (a fused projection's parts stacked, each with its row order)."""
        first = 0
        for part in parts:
            ops.pack(self.rows_of(first, part.rows), int(part.qtype), part.data, part.order)
            first += part.rows

    # The types that only exist on the kernels (the lanes layouts packed from GGUF blocks) compute through them.
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel_forward(x)

    def dequantized(self) -> torch.Tensor:
        """W as a dense float32 [out, in] tensor, exactly what the kernels multiply by (gguf's values)."""
        return self.kernel_dequantized()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W in float32: the embedding lookup of a GGUF file's table of this type."""
        return self.kernel_embed(ids)


class StackedWeight(KernelWeight):
    """A projection fused along its outputs (q/k/v, gate/up) whose parts are of different weight types, each kept in
    its own: a GGUF file's Q4_K_M stores some layers' v in Q6_K beside a Q4_K q and k, and one type for all three
    would mean requantizing the file's values. The kernels run each part on its own path into its columns of one
    output (kernels.h `Linear.next`), in the op-at-a-time calls and the fused decode step alike."""

    def __init__(self, parts: list[KernelWeight]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)
        biases = [part.bias for part in parts]
        self.bias = None if all(b is None for b in biases) else torch.cat([b.data for b in biases])

    def describe(self) -> Linear:
        descriptions = [part.describe() for part in self.parts]
        for this, after in itertools.pairwise(descriptions):
            this.next = ctypes.pointer(after)  # the pointer object keeps `after` alive with `this`
        return descriptions[0]

    def dequantized(self) -> torch.Tensor:
        return torch.cat([part.dequantized() for part in self.parts])

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, parts stacked along the outputs"
