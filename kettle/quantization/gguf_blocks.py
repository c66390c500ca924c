"""GGUF quantized blocks decoded into Kettle's int4 form: 4-bit values with a scale and a minimum per 32 weights.

Q4_0 (w = d · (q - 8)), Q4_1 (w = d · q + m) and Q4_K (w = d · sc · q - dmin · m per sub-block of 32) all lie on
a 4-bit grid with groups of 32 input channels, so they become `Q4Linear`'s layout (w = q · scale + min) without
rounding any weight: only the nibble order changes (a GGUF block keeps elements j and j + 16 in byte j, Kettle's
chunks j and j + 32). The scales and minimums the kernel reads are float16, which Q4_0 and Q4_1 store as is;
Q4_K's products d · sc and dmin · m are rounded once to float16 (relative error ≤ 2⁻¹¹ on a scale).

The other types GGUF files carry are either dense (F32, F16, BF16: dequantized, kept in the model dtype) or
served on the nearest scheme (Q8_0, Q5_0, Q5_1, Q5_K, Q6_K: dequantized, then int8 per output channel).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from kettle.tensors.gguf_file import Blocks

GROUP = 32


@dataclass
class Int4Groups:
    """W[n, k] = q[n, k] · scales[n, k // 32] + mins[n, k // 32]: q uint8 [N, K] in 0..15, scales and mins
    float32 [N, K/32] (each an exact float16 value for Q4_0/Q4_1)."""

    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    def rows(self, order: torch.Tensor) -> Int4Groups:
        """The output channels in `order` (the llama.cpp q/k head permutation undone: whole rows move)."""
        return Int4Groups(self.q[order], self.scales[order], self.mins[order])

    def dequantized(self) -> torch.Tensor:
        n, k = self.q.shape
        groups = self.q.float().view(n, -1, GROUP) * self.scales[..., None] + self.mins[..., None]
        return groups.view(n, k)


def int4_groups(blocks: Blocks) -> Int4Groups:
    """The raw blocks of a Q4_0/Q4_1/Q4_K tensor → `Int4Groups`, rows in Hugging Face order."""
    decode = {T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q4_K: _q4_k}[blocks.qtype]
    q, scales, mins = decode(np.ascontiguousarray(blocks.data).reshape(-1))
    shape = (blocks.rows, blocks.cols // GROUP)
    groups = Int4Groups(
        torch.from_numpy(np.ascontiguousarray(q)).view(blocks.rows, blocks.cols),
        torch.from_numpy(np.ascontiguousarray(scales)).reshape(shape),
        torch.from_numpy(np.ascontiguousarray(mins)).reshape(shape),
    )
    return groups if blocks.order is None else groups.rows(blocks.order)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes → [blocks, 32] values: low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(data: np.ndarray):
    blocks = data.reshape(-1, 18)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
    return _nibbles_32(blocks[:, 2:]), d, -8 * d  # -8 · d is exact: a power of two times a float16


def _q4_1(data: np.ndarray):
    blocks = data.reshape(-1, 20)
    halves = blocks[:, :4].copy().view(np.float16).astype(np.float32)
    return _nibbles_32(blocks[:, 4:]), halves[:, 0], halves[:, 1]


def _q4_k(data: np.ndarray):
    from gguf.quants import Q4_K

    blocks = data.reshape(-1, 144)
    halves = blocks[:, :4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    scales = halves[:, :1] * sc.astype(np.float32)
    mins = -(halves[:, 1:2] * m.astype(np.float32))
    # 128 bytes of nibbles: four runs of 32 bytes, each holding sub-block 2c (low nibbles) and 2c + 1 (high).
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & 0x0F).reshape(-1, 256), scales, mins
