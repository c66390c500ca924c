"""GGUF's Q8_0 served as it is stored: int8 weights with one float16 scale per block of 32 input channels.

W = q · d per block, the file's own grid, so nothing is rounded on the way in (per-channel int8 would round every
weight a second time). The kernels (kettle/kernels/cpu_kernels.c, `LINEAR_Q8G`) fold each block's scale into the
activations' per-block scale for the integer dot products, or dequantize a row at a time for the float32 tiles
and the prompt GEMM. A tied Q8_0 embedding table reads its rows from the same storage (`embed`), so the
embedding needs no float copy.

Where the kernels run (AVX-512 VNNI, or AVX2 with lanes_avx2.c's tiles), a weight with a multiple of 16 output
channels is stored in lanes (kernels.h's Q8L layout, as int4's in kettle/quantization/q4.py): each pair of inputs
of 16 channels side by side, so one `vpdpwssd` advances 16 channels for a row and the rows of a step share each
weight vector. The bundled model's head (49,152 channels) at four rows, a speculative step's verification: 1.4-1.8
ms against 2.4-2.5 in rows. On AVX2 a 1.7B file decoded 1.05x faster in lanes than in rows, its prompts 0.91x
(lanes_avx2.c).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from kettle.kernels import ops
from kettle.kernels.structs import LINEAR_Q8G, LINEAR_Q8L, Linear
from kettle.quantization.kernel_weight import KernelWeight, pointer
from kettle.quantization.q4 import LANES, table_from_lanes, table_to_lanes
from kettle.tensors import huge_pages
from kettle.tensors.gguf_file import Blocks

BLOCK = 32  # input channels per scale


def fits(n: int, k: int) -> bool:
    """Whether a Q8_0 weight of n output channels and k inputs is held in lanes here (packed by the kernels at load:
    `Q8Linear.from_packed_blocks`)."""
    return ops.lanes(LINEAR_Q8L) and n % LANES == 0 and k % BLOCK == 0


BLOCK_BYTES = 2 + BLOCK  # a Q8_0 block: float16 d, then 32 int8 values


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] → (q int8 [N, K], scales float16 [N, K/32]) on Q8_0's grid as llama.cpp quantizes to it: per
    block of 32, d = amax / 127 (stored as float16) and q = w · (1 / d) rounded half away from zero, as C's `roundf`
    (a requantized K-type's values often fall on the halves)."""
    n, k = weight.shape
    blocks = weight.float().view(n, k // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=-1) / 127
    scaled = blocks * torch.where(d > 0, 1 / d, torch.zeros_like(d))[..., None]
    whole = scaled.abs().floor()
    q = torch.sign(scaled) * (whole + torch.floor(2 * (scaled.abs() - whole)))
    return q.to(torch.int8).view(n, k), d.to(torch.float16)


def to_lanes(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int8 and scales [N, K/32] → kernels.h's Q8L layout in tensors of the same shapes: quad vector m of
    block b of channels 16G.. holds input 4m + 2j + e of channel 16G + c at byte 4c + 2e + j; scales
    [N/16][K/32][16]."""
    n, k = q.shape
    quads = q.view(n // LANES, LANES, k // BLOCK, BLOCK // 4, 2, 2).permute(0, 2, 3, 1, 5, 4)  # [G, b, m, c, e, j]
    return quads.reshape(n, k).contiguous(), table_to_lanes(scales)


def from_lanes(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `to_lanes`."""
    n, k = q.shape
    rows = q.view(n // LANES, k // BLOCK, BLOCK // 4, LANES, 2, 2).permute(0, 3, 1, 2, 5, 4)  # [G, c, b, m, j, e]
    return rows.reshape(n, k).contiguous(), table_from_lanes(scales)


class Q8Linear(KernelWeight):
    """y = x Wᵀ (+ b) with W [out, in] in GGUF's Q8_0 layout on Kettle's CPU kernels; same call shape as `Linear`."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        n, k = q.shape
        if k % BLOCK or scales.shape != (n, k // BLOCK):
            raise ValueError(f"Q8_0: in_features {k} must be a multiple of {BLOCK}, with one scale per block")
        self.out_features, self.in_features = int(n), int(k)
        q, scales = q.to(torch.int8).contiguous(), scales.to(torch.float16).contiguous()
        self.lanes = n % LANES == 0 and ops.lanes(LINEAR_Q8L)  # the Q8L layout: `q` and `scales` hold it (`to_lanes`)
        if self.lanes:
            q, scales = to_lanes(q, scales)
        # In 2 MiB pages, as `from_packed_blocks` allocates: a requantized Q6_K file's weights (the only copy a decode
        # step streams) in PyTorch's 4 KiB pages decoded at 22.6 tok/s on an AVX2 CPU where the Q8_0 file's, the same
        # layout and bytes in huge pages, ran at 27.7 (a TLB miss every 4 KiB; kettle/tensors/huge_pages.py).
        self.register_buffer("q", huge_pages.placed(q), persistent=False)
        self.register_buffer("scales", huge_pages.placed(scales), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)

    @classmethod
    def from_blocks(cls, blocks: Blocks, bias: torch.Tensor | None = None) -> Q8Linear:
        """The raw blocks of a Q8_0 tensor, rows in Hugging Face order."""
        raw = np.ascontiguousarray(blocks.data).reshape(-1, BLOCK_BYTES)
        scales = torch.from_numpy(raw[:, :2].copy().view(np.float16)).view(blocks.rows, blocks.cols // BLOCK)
        q = torch.from_numpy(raw[:, 2:].copy().view(np.int8)).view(blocks.rows, blocks.cols)
        if blocks.order is not None:
            q, scales = q[blocks.order], scales[blocks.order]
        return cls(q, scales, bias)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Q8Linear:
        """A dense [out, in] weight quantized to Q8_0's blocks (`quantize_blocks`)."""
        return cls(*quantize_blocks(weight), bias)

    @classmethod
    def from_packed_blocks(cls, parts: list[Blocks], bias: torch.Tensor | None = None) -> Q8Linear:
        """Q8_0 tensors' blocks (a fused projection's parts stacked, rows in Hugging Face order) packed by the kernels
        straight from the file's bytes into lanes (`ops.pack`, over all threads); the caller checks `fits`."""
        n, k = sum(b.rows for b in parts), parts[0].cols
        layer = cls.__new__(cls)
        KernelWeight.__init__(layer)
        layer.out_features, layer.in_features, layer.lanes = n, k, True
        layer.register_buffer("q", huge_pages.empty(n, k, dtype=torch.int8), persistent=False)
        layer.register_buffer("scales", torch.empty(n, k // BLOCK, dtype=torch.float16), persistent=False)
        layer.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)
        layer.pack_parts(parts)
        return layer

    def rows_of(self, first: int, count: int) -> Linear:
        """Output channels first .. first + count - 1 (in lanes: multiples of 16) as a weight of their own."""
        rows = slice(first, first + count)
        kind = LINEAR_Q8L if self.lanes else LINEAR_Q8G
        return Linear(kind, BLOCK, count, self.in_features, *map(pointer, (self.q[rows], self.scales[rows])))

    @classmethod
    def concat(cls, parts: list[Q8Linear], bias: torch.Tensor | None) -> Q8Linear:
        """Projections fused along the outputs (q|k|v, gate|up)."""
        stored = [p.stored() for p in parts]
        return cls(torch.cat([q for q, _ in stored]), torch.cat([s for _, s in stored]), bias)

    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """q [N, K] and scales [N, K/32] in the file's order (out of lanes)."""
        return from_lanes(self.q, self.scales) if self.lanes else (self.q, self.scales)

    def dequantized(self) -> torch.Tensor:
        """W as a dense float32 [out, in] tensor, exactly the file's dequantization."""
        q, scales = self.stored()
        blocks = q.float().view(self.out_features, -1, BLOCK) * scales.float()[..., None]
        return blocks.view(self.out_features, self.in_features)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W in float32: the embedding lookup of a tied Q8_0 table."""
        if ops.available():
            return self.kernel_embed(ids)
        rows = self.q[ids].float().view(*ids.shape, -1, BLOCK) * self.scales[ids].float()[..., None]
        return rows.view(*ids.shape, self.in_features)

    def describe(self) -> Linear:
        kind = LINEAR_Q8L if self.lanes else LINEAR_Q8G
        tensors = (self.q, self.scales, None, self.bias)
        return Linear(kind, 32, self.out_features, self.in_features, *map(pointer, tensors))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ops.available():
            return self.kernel_forward(x)
        # PyTorch's ops over the dequantized weight (machines without the kernels)
        y = torch.nn.functional.linear(x.reshape(-1, self.in_features).float(), self.dequantized(), self.bias)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, Q8_0{', lanes' if self.lanes else ''}"
