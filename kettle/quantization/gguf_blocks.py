"""GGUF quantized blocks decoded into Kettle's int4 form: 4-bit values with a scale and a minimum per 32 weights.

Q4_0 (w = d · (q - 8)), Q4_1 (w = d · q + m) and Q4_K (w = d · sc · q - dmin · m per sub-block of 32) all lie on
a 4-bit grid with groups of 32 input channels, so they become `Q4Linear`'s layout (w = q · scale + min) without
rounding any weight: only the nibble order changes (a GGUF block keeps elements j and j + 16 in byte j, Kettle's
chunks j and j + 32), and it changes byte by byte, two values at a time, never one value a byte (Q4_K's runs of
32 bytes are Kettle's chunks already). The scales and minimums the kernel reads are float16, which Q4_0 and Q4_1
store as is. Q4_K keeps its own 6-bit scales (as bytes) and super-block d and dmin too (`Int4Groups.q4k`): a weight
in lanes reads those, its products exactly gguf's; elsewhere its products d · sc and dmin · m are rounded once to
float16 (relative error ≤ 2⁻¹¹ on a scale).

The other types GGUF files carry are dense (F32, F16, BF16: dequantized, kept in the model dtype) or have layouts of
their own (Q8_0; in lanes Q5_0, Q5_1, Q5_K and Q6_K, packed from the blocks: kettle/quantization/gguf_scheme.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from kettle.quantization.q4 import CHUNK, q4k_products, unpack_q4
from kettle.tensors.gguf_file import Blocks

GROUP = 32


@dataclass
class Int4Groups:
    """W[n, k] = q[n, k] · scales[n, k // 32] + mins[n, k // 32], q in 0..15: `values` holds q packed two a
    byte in `Q4Linear`'s layout ([N, K/2], `pack_q4`) where K is a multiple of its 64-wide chunks (`packed`), else
    one a byte ([N, K]); scales and mins float32 [N, K/32] (each an exact float16 value for Q4_0/Q4_1)."""

    values: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    packed: bool
    # Q4_K's own scales: sc and m [N, K/32] uint8 and the super-blocks' d and dmin [N, K/256, 2] float16, of which
    # `scales` and `mins` are the products (`Q4Linear` keeps these in lanes); None for Q4_0 and Q4_1.
    q4k: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def q(self) -> torch.Tensor:
        """q uint8 [N, K], one value a byte."""
        return unpack_q4(self.values).to(torch.uint8) if self.packed else self.values

    def rows(self, order: torch.Tensor) -> Int4Groups:
        """The output channels in `order` (the llama.cpp q/k head permutation undone: whole rows move)."""
        q4k = None if self.q4k is None else tuple(part[order] for part in self.q4k)
        return Int4Groups(self.values[order], self.scales[order], self.mins[order], self.packed, q4k)

    def dequantized(self) -> torch.Tensor:
        n, k = self.q.shape
        groups = self.q.float().view(n, -1, GROUP) * self.scales[..., None] + self.mins[..., None]
        return groups.view(n, k)


def int4_groups(blocks: Blocks) -> Int4Groups:
    """The raw blocks of a Q4_0/Q4_1/Q4_K tensor → `Int4Groups`, rows in Hugging Face order."""
    decode = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q4_K: _q4_k}[blocks.qtype]
    packed = blocks.cols % CHUNK == 0  # Q4_K always: its super-blocks are 256 wide
    values, *tables = decode(np.asarray(blocks.data).reshape(-1), packed)
    shape = (blocks.rows, blocks.cols // GROUP)
    values = as_tensor(values, (blocks.rows, blocks.cols // (2 if packed else 1)))
    if blocks.qtype == T.Q4_K:  # sc, m and each super-block's d, dmin: the products from them (`q4k_products`)
        q4k = (as_tensor(tables[0], shape), as_tensor(tables[1], shape), as_tensor(tables[2], (blocks.rows, -1, 2)))
        groups = Int4Groups(values, *q4k_products(*q4k), packed, q4k)
    else:
        groups = Int4Groups(values, as_tensor(tables[0], shape), as_tensor(tables[1], shape), packed)
    return groups if blocks.order is None else groups.rows(blocks.order)


def as_tensor(array: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """A decoded numpy array as a contiguous tensor of `shape` (a view of it where it is contiguous already)."""
    return torch.from_numpy(np.ascontiguousarray(array)).reshape(shape)


def _nibbles(qs: np.ndarray, packed: bool) -> np.ndarray:
    """[blocks, 16] bytes of GGUF's Q4_0/Q4_1 (element e in byte e % 16, low nibble for e < 16) → `Q4Linear`'s
    chunks, blocks 2c and 2c + 1 in chunk c's low and high nibbles ([blocks / 2, 32] bytes), or one value a byte
    ([blocks, 32]) when not `packed`."""
    if not packed:
        return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    pairs = qs.reshape(-1, 2, 16)
    first, second = pairs[:, 0], pairs[:, 1]
    return np.concatenate([(first & 0x0F) | (second << 4), (first >> 4) | (second & 0xF0)], axis=-1)


def _q4_0(data: np.ndarray, packed: bool):
    blocks = data.reshape(-1, 18)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
    return _nibbles(blocks[:, 2:], packed), d, -8 * d  # -8 · d is exact: a power of two times a float16


def _q4_1(data: np.ndarray, packed: bool):
    blocks = data.reshape(-1, 20)
    halves = blocks[:, :4].copy().view(np.float16).astype(np.float32)
    return _nibbles(blocks[:, 4:], packed), halves[:, 0], halves[:, 1]


def _q4_k(data: np.ndarray, packed: bool):
    from gguf.quants import Q4_K

    blocks = data.reshape(-1, 144)
    supers = blocks[:, :4].copy().view(np.float16)  # d, dmin
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    # 128 bytes of nibbles: four runs of 32 bytes, each holding sub-block 2c (low nibbles) and 2c + 1 (high):
    # `Q4Linear`'s chunks as they are.
    assert packed, "Q4_K rows are whole 256-wide super-blocks"
    return blocks[:, 16:].reshape(-1, 128), sc.astype(np.uint8), m.astype(np.uint8), supers
