"""GGUF's 5-bit types on Kettle's CPU kernels, from the file's own bits, q in 0..31: Q5_K (w = d · sc · q - dmin · m,
Q4_K's 6-bit scales per 32 inputs and d, dmin per 256), Q5_1 (w = d · q + m per 32) and Q5_0 (w = d · (q - 16)).

The kernels hold them in lanes (kernels.h's Q5L: the nibbles as Q4L lays them out, the fifth bits in a byte beside each
of the quad vectors' bytes, Q4_K's scale tables or a float16 scale and minimum per block) and pack them straight
from the file's blocks at load (kettle/kernels/gguf_pack.c), with AVX-512 VNNI or on AVX2's tiles
(kettle/kernels/lanes_avx2.c). Where lanes do not apply (a shape that is not whole blocks of 16 channels, or the
kernels' lanes switched off) they take the nearest scheme, Q8_0's blocks requantized (gguf_scheme.py
`_requantized`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kettle.kernels import ops
from kettle.kernels.structs import LINEAR_Q5L, Linear
from kettle.quantization.config import DENSE_ROWS
from kettle.quantization.kernel_weight import KernelWeight, pointer
from kettle.quantization.q4 import BLOCK, LANES, SUPER_BLOCK
from kettle.tensors import huge_pages

if TYPE_CHECKING:
    from kettle.tensors.gguf_file import Blocks


def fits(n: int, k: int, k_quant: bool = True) -> bool:
    """Whether a Q5_K (`k_quant`) or Q5_0/Q5_1 weight of n output channels and k inputs is held in lanes here (the only
    layout its kernel reads)."""
    return ops.lanes(LINEAR_Q5L) and n % LANES == 0 and k % (SUPER_BLOCK if k_quant else BLOCK) == 0


class Q5Linear(KernelWeight):
    """y = x Wᵀ (+ b) with W [out, in] in GGUF's Q5_K, in lanes on Kettle's CPU kernels; same call shape as
    `Linear`."""

    def __init__(self, n: int, k: int, bias: torch.Tensor | None = None, k_quant: bool = True) -> None:
        """Room for an n × k weight (the caller checks `fits`), filled by `from_blocks`: Q5_K's tables (`k_quant`:
        6-bit sc and m as bytes, d and dmin per 256), else Q5_0's and Q5_1's (a float16 scale and minimum per 32)."""
        super().__init__()
        self.out_features, self.in_features, self.dense_rows = n, k, DENSE_ROWS
        # 320 bytes a block of 32 inputs for 16 channels: the fifth bits' planes, then the nibbles.
        self.register_buffer("weight_bytes", huge_pages.empty(n, k * 5 // 8, dtype=torch.uint8), persistent=False)
        table = torch.uint8 if k_quant else torch.float16
        self.register_buffer("scales", torch.empty(n, k // BLOCK, dtype=table), persistent=False)
        self.register_buffer("mins", torch.empty(n, k // BLOCK, dtype=table), persistent=False)
        supers = torch.empty(n, k // SUPER_BLOCK * 2, dtype=torch.float16) if k_quant else None
        self.register_buffer("supers", supers, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)

    @classmethod
    def from_blocks(cls, parts: list[Blocks], bias: torch.Tensor | None = None) -> Q5Linear:
        """GGUF Q5_K, or Q5_0 and Q5_1, tensors' blocks, rows in Hugging Face order (`Blocks.order`), as one
        projection (a fused one: the parts' output channels stacked), packed by the kernels from the file's bytes."""
        k_quant = parts[0].qtype.name == "Q5_K"
        layer = cls(sum(b.rows for b in parts), parts[0].cols, bias, k_quant)
        layer.pack_parts(parts)
        return layer

    def rows_of(self, first: int, count: int) -> Linear:
        """Output channels first .. first + count - 1 (multiples of 16) as a weight of their own, without bias."""
        rows = slice(first, first + count)
        supers = None if self.supers is None else self.supers[rows]
        tensors = (self.weight_bytes[rows], self.scales[rows], self.mins[rows], None, supers)
        return Linear(LINEAR_Q5L, BLOCK, count, self.in_features, *map(pointer, tensors))

    def describe(self) -> Linear:
        tensors = (self.weight_bytes, self.scales, self.mins, self.bias, self.supers)
        return Linear(LINEAR_Q5L, BLOCK, self.out_features, self.in_features, *map(pointer, tensors))

    def extra_repr(self) -> str:
        kind = "q5_k" if self.supers is not None else "q5_0/q5_1"
        return f"in={self.in_features}, out={self.out_features}, {kind}, kernel=kettle, lanes"
