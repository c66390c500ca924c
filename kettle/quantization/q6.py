"""GGUF's Q6_K on Kettle's CPU kernels, in lanes (kernels.h's Q6L layout): the file's own 6.56 bits a weight.

Q6_K stores w = d · sc · (q - 32) with q in 0..63 (its low 4 bits and high 2 bits in separate arrays), an int8
scale sc per 16 inputs and a float16 d per 256. Kettle keeps exactly those values: the low bits of 16 output
channels side by side (Q4L's, kettle/quantization/q4.py `to_lanes`, stored as its kernel interleaves them), the
high bits beside them in each block, and the two scale tables side by side for 16 channels, so the lanes kernel
multiplies q (0..63) with int8 activations as it does Q4L's nibbles, keeping the sums of each sub-block of 16 apart
for its own scale, less 32 · the sub-block's inputs. Each block is stored in the order the kernel reads it: a decode
step of a Q6_K file is bound by the kernel's work per byte, not only by memory. The dequantized weights are gguf's
own, bit for bit ((d · sc) · (q - 32), the products gguf forms).

Where weights are held in lanes (AVX-512 VNNI, or AVX2 with kettle/kernels/lanes_avx2.c's tiles; N a multiple of
16, K of 256: `fits`); elsewhere Q6_K serves on the nearest scheme, requantized to Q8_0's blocks
(kettle/quantization/gguf_scheme.py `_requantized`). On AVX2 Q6_K was requantized so until its blocks were stored in
quad order (its tile then unpacked each block's high bits per pair of units, slower than Q8_0's blocks); now the
file's own values decode a 1.7B Q6_K file as fast as Q8_0's blocks did or faster, and a Q4_K_M file's Q6_K parts
1.2-1.4x faster (bench/RESULTS.md).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from kettle.kernels import ops
from kettle.kernels.structs import LINEAR_Q6L, Linear
from kettle.quantization.config import DENSE_ROWS
from kettle.quantization.gguf_blocks import as_tensor
from kettle.quantization.kernel_weight import KernelWeight, pointer
from kettle.quantization.q4 import LANES, SUPER_BLOCK, table_to_lanes
from kettle.tensors import huge_pages
from kettle.tensors.gguf_file import Blocks

BLOCK_BYTES = 210  # a Q6_K super-block: 128 bytes of low bits, 64 of high bits, 16 int8 scales, float16 d


def fits(n: int, k: int) -> bool:
    """Whether a Q6_K weight of n output channels and k inputs is held in lanes here (the only layout its kernel
    reads)."""
    return ops.lanes(LINEAR_Q6L) and n % LANES == 0 and k % SUPER_BLOCK == 0


def decode_blocks(data: np.ndarray, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q6_K tensor's raw blocks [n, k / 256 · 210 bytes] → q [n, k] uint8 (0..63), scales [n, k/16] int8 and d
    [n, k/256] float16, the file's values (gguf.quants' Q6_K bit order)."""
    blocks = np.asarray(data).reshape(-1, BLOCK_BYTES)
    low, high = blocks[:, :128].reshape(-1, 2, 1, 64), blocks[:, 128:192].reshape(-1, 2, 1, 32)
    low = (low >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (high >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = low.reshape(-1, SUPER_BLOCK) | (high.reshape(-1, SUPER_BLOCK) << 4)
    scales = blocks[:, 192:208].copy().view(np.int8)
    d = blocks[:, 208:210].copy().view(np.float16)
    return as_tensor(q, (n, k)), as_tensor(scales, (n, k // 16)), as_tensor(d, (n, k // SUPER_BLOCK))


def to_lanes(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] (0..63) → kernels.h's Q6L weight bytes [N, K · 3/4]: per 16 channels and block of 32, in t order
    (inputs i(m, t) = 4m + (0, 2, 1, 3)[t]), 4 vectors of the low 4 bits (byte 4c + t of vector m: input i(m, t)'s,
    16 + i(m, t)'s in the high nibble), then 2 of the high 2 bits (byte 4c + t of vector p: inputs i(2p + 1, t) and
    16 + i(2p + 1, t) at bits 0-1 and 2-3, i(2p, t) and 16 + i(2p, t) at 4-5 and 6-7)."""
    n, k = q.shape
    q = q.view(n // LANES, LANES, k // 32, 2, 4, 4)[..., [0, 2, 1, 3]]  # [G, c, b, half, m, t]
    low, high = q & 0x0F, q >> 4
    units = (low[:, :, :, 0] | (low[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)  # [G, b, m, c, t]
    fields = high[:, :, :, 0] | (high[:, :, :, 1] << 2)
    fields = fields.view(n // LANES, LANES, k // 32, 2, 2, 4)  # [G, c, b, p, odd, t]
    bits = (fields[:, :, :, :, 1] | (fields[:, :, :, :, 0] << 4)).permute(0, 2, 3, 1, 4)  # [G, b, p, c, t]
    blocks = torch.cat([units.reshape(n // LANES, k // 32, 256), bits.reshape(n // LANES, k // 32, 128)], dim=2)
    return blocks.reshape(n, k * 3 // 4).contiguous()


class Q6Linear(KernelWeight):
    """y = x Wᵀ (+ b) with W [out, in] in GGUF's Q6_K, in lanes on Kettle's CPU kernels; same call shape as
    `Linear`."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, d: torch.Tensor, bias=None) -> None:
        """From q [N, K] (0..63), scales [N, K/16] int8 and d [N, K/256] float16 (`decode_blocks`); the caller
        checks `fits`."""
        super().__init__()
        n, k = q.shape
        self.out_features, self.in_features = int(n), int(k)
        self.dense_rows = DENSE_ROWS
        # In 2 MiB pages as the packed weights are (huge_pages.placed): a decode step streams them from memory.
        self.register_buffer("weight_bytes", huge_pages.placed(to_lanes(q.to(torch.uint8))), persistent=False)
        self.register_buffer("scales", table_to_lanes(scales.to(torch.int8)), persistent=False)
        self.register_buffer("d", table_to_lanes(d.to(torch.float16)), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)

    @classmethod
    def from_blocks(cls, parts: list[Blocks], bias=None) -> Q6Linear:
        """GGUF Q6_K tensors' blocks, rows in Hugging Face order (`Blocks.order`: whole rows move), as one
        projection (a fused one: the parts' output channels stacked), packed by the kernels straight from the
        file's bytes into lanes (`ops.pack`: one pass over all threads, where decoding and moving them in tensor
        ops took ~4 s of a 1.7B Q4_K_M file's load)."""
        n, k = sum(b.rows for b in parts), parts[0].cols
        layer = cls.__new__(cls)
        KernelWeight.__init__(layer)
        layer.out_features, layer.in_features, layer.dense_rows = n, k, DENSE_ROWS
        layer.register_buffer("weight_bytes", huge_pages.empty(n, k * 3 // 4, dtype=torch.uint8), persistent=False)
        layer.register_buffer("scales", torch.empty(n, k // 16, dtype=torch.int8), persistent=False)
        layer.register_buffer("d", torch.empty(n, k // SUPER_BLOCK, dtype=torch.float16), persistent=False)
        layer.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)
        layer.pack_parts(parts)
        return layer

    def rows_of(self, first: int, count: int) -> Linear:
        """Output channels first .. first + count - 1 (multiples of 16) as a weight of their own, without bias."""
        rows = slice(first, first + count)
        tensors = (self.weight_bytes[rows], self.scales[rows], None, None, self.d[rows])
        return Linear(LINEAR_Q6L, 32, count, self.in_features, *map(pointer, tensors))

    def describe(self) -> Linear:
        tensors = (self.weight_bytes, self.scales, None, self.bias, self.d)
        return Linear(LINEAR_Q6L, 32, self.out_features, self.in_features, *map(pointer, tensors))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, q6_k, kernel=kettle, lanes"
