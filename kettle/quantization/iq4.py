"""GGUF's IQ4_XS on Kettle's CPU kernels, from the file's own bits: w = d · (ls - 32) · IQ4_VALUES[q], q a 4-bit index
into a fixed non-uniform grid, ls a 6-bit scale per 32 inputs, d a float16 per 256 (4.25 bits a weight).

The kernels hold it in lanes (kernels.h's IQ4L: the indices laid out as Q4L's units, looked up in the grid as they are
widened; the scales as int8 and d per 16 channels) and pack it straight from the file's blocks at load
(kettle/kernels/gguf_pack.c). Where lanes do not apply it keeps the nearest scheme, int8 per output channel
(gguf_scheme.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kettle.kernels import ops
from kettle.kernels.structs import LINEAR_IQ4L, Linear
from kettle.quantization.config import DENSE_ROWS
from kettle.quantization.kernel_weight import KernelWeight, pointer
from kettle.quantization.q4 import BLOCK, LANES, SUPER_BLOCK
from kettle.tensors import huge_pages

if TYPE_CHECKING:
    from kettle.tensors.gguf_file import Blocks


def fits(n: int, k: int) -> bool:
    """Whether an IQ4_XS weight of n output channels and k inputs is held in lanes here."""
    return ops.lanes(LINEAR_IQ4L) and n % LANES == 0 and k % SUPER_BLOCK == 0


class IQ4Linear(KernelWeight):
    """y = x Wᵀ (+ b) with W [out, in] in GGUF's IQ4_XS, in lanes on Kettle's CPU kernels; same call shape as
    `Linear`."""

    def __init__(self, n: int, k: int, bias: torch.Tensor | None = None) -> None:
        """Room for an n × k weight (the caller checks `fits`), filled by `from_blocks`."""
        super().__init__()
        self.out_features, self.in_features, self.dense_rows = n, k, DENSE_ROWS
        self.register_buffer("weight_bytes", huge_pages.empty(n, k // 2, dtype=torch.uint8), persistent=False)
        self.register_buffer("scales", torch.empty(n, k // BLOCK, dtype=torch.int8), persistent=False)
        self.register_buffer("supers", torch.empty(n, k // SUPER_BLOCK, dtype=torch.float16), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)

    @classmethod
    def from_blocks(cls, parts: list[Blocks], bias: torch.Tensor | None = None) -> IQ4Linear:
        """GGUF IQ4_XS tensors' blocks, rows in Hugging Face order (`Blocks.order`), as one projection (a fused one:
        the parts' output channels stacked), packed by the kernels from the file's bytes."""
        layer = cls(sum(b.rows for b in parts), parts[0].cols, bias)
        layer.pack_parts(parts)
        return layer

    def rows_of(self, first: int, count: int) -> Linear:
        """Output channels first .. first + count - 1 (multiples of 16) as a weight of their own, without bias."""
        rows = slice(first, first + count)
        tensors = (self.weight_bytes[rows], self.scales[rows], None, None, self.supers[rows])
        return Linear(LINEAR_IQ4L, BLOCK, count, self.in_features, *map(pointer, tensors))

    def describe(self) -> Linear:
        tensors = (self.weight_bytes, self.scales, None, self.bias, self.supers)
        return Linear(LINEAR_IQ4L, BLOCK, self.out_features, self.in_features, *map(pointer, tensors))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, iq4_xs, kernel=kettle, lanes"
