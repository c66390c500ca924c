"""Group-wise int4 weight-only linear layers on PyTorch's packed int4 kernels (CPU, and CUDA's tinygemm).

Each group of `group_size` consecutive input channels of one output channel has its own scale and zero, and
the weight is w = (q - 8) · scale + zero with q in 0..15 (the float-zero form of PyTorch's int4 kernels).
`torch.ops.aten._weight_int4pack_mm_for_cpu` streams the packed nibbles (half a byte a weight, an eighth of
float32) and dequantizes them in registers. It accepts float32 activations, but on this AVX2 CPU only its
bfloat16 path is fast (measured: `python -m bench decode --vs kernels`), so activations are cast to bfloat16
per call and the output back; the scales and zeros are kept in bfloat16 too (the kernel wants the activations' dtype).

Checkpoints quantized elsewhere (GPTQ, AWQ) reach this layer through `Int4Linear.from_qparams`: their
w = s · (q - z) is the same function with scale = s and zero = s · (8 - z).

Large prefills can be faster on a dense float32 GEMM than on the packed kernel (it is a decode kernel): with
`dense_rows` set, a call with more rows dequantizes the weight for that call only (never kept).

On a CUDA device the same parameters go to PyTorch's tinygemm kernel (`_convert_weight_to_int4pack` /
`_weight_int4pack_mm`, bfloat16 only, tensor cores on sm80+; fast at one sequence, but it reads the weight again
per 16 rows), or with `KETTLE_TUNING=cuda-int4-kernel=triton` to Kettle's Triton kernel
(kettle/quantization/int4_cuda.py: the nibbles in plain [N, K/2] pairs, rows in tensor-core tiles; faster from ~32
rows, slower below). The function
w = (q - 8) · scale + zero is the same everywhere. Both are decode kernels, far below cuBLAS on a long prefill,
so there too calls with more than `dense_rows` rows multiply a dense copy dequantized for the call
(`unpack_int4_cuda` inverts tinygemm's tiling with tensor ops).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kettle import settings
from kettle.quantization import int4_cuda
from kettle.quantization.config import DEFAULT_INT4_GROUP_SIZE, DENSE_ROWS, KERNEL_ACT_DTYPE

# Group sizes the packed CPU kernel implements; a checkpoint's larger group is split into these (exactly: the
# sub-groups repeat its scale and zero).
KERNEL_GROUP_SIZES = (256, 128, 64, 32)
# The CPU packing's candidate layouts as (channels a block, whether a full block splits it in halves), see
# `cpu_pack_layout`; every layout stores a last block of any multiple of 16 channels, so N must be one.
_CPU_PACK_LAYOUTS = ((64, True), (32, True), (32, False))


# tinygemm tiles K by 16 × inner_k_tiles (2, 4 or 8); 8 gives its widest (16-byte) loads.
CUDA_INNER_K_TILES = (8, 4, 2)


def cuda_inner_k_tiles(in_features: int) -> int:
    """The widest tinygemm inner k-tiling that divides `in_features` (any multiple of 32 has one)."""
    for tiles in CUDA_INNER_K_TILES:
        if in_features % (16 * tiles) == 0:
            return tiles
    raise ValueError(f"int4 on CUDA: in_features must be a multiple of 32, got {in_features}")


def pack_int4_cuda(q: torch.Tensor) -> torch.Tensor:
    """q int32 [N, K] (0..15) on a CUDA device → tinygemm's layout: two values a byte (even k in the high
    nibble, as `_convert_weight_to_int4pack` expects since torch 2.5), then its tensor-core tiling."""
    pairs = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack(pairs, cuda_inner_k_tiles(q.shape[1]))


def unpack_int4_cuda(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of `_convert_weight_to_int4pack` (CUDA): packed int32 [N/8, K/(16·T), 32, T/2] → q [N, K].

    Read off PyTorch's `matrix_to_m16n8k16_Bint4_layout` (aten/src/ATen/native/cuda/int4mm.cu): lane t of a
    warp holds output channel 8·tile + t // 4; word j of the lane packs inner k-tiles 2j and 2j + 1; nibble
    4h + 2c + d (h = 0 the even input channel, 1 the odd one) holds input channel
    16·(T·outer + 2j + c) + 8d + 2·(t % 4) + h. So the nibbles, viewed [tile, outer, t//4, t%4, j, h, c, d],
    only need a permutation to [tile, t//4 | outer, j, c, d, t%4, h] = [N, K]."""
    tiles, outer, _, words = packed.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift: the mask drops the sign bits
    nibbles = nibbles.view(tiles, outer, 8, 4, words, 2, 2, 2)
    return nibbles.permute(0, 2, 1, 4, 6, 7, 3, 5).reshape(n, k)


def kernel_group_size(in_features: int, wanted: int) -> int:
    """The largest kernel group size ≤ `wanted` that divides both `in_features` and `wanted`.

    SmolLM2's hidden size 576 is not a multiple of 128, so its layers get 64 under the default of 128.
    """
    for size in KERNEL_GROUP_SIZES:
        if size <= wanted and in_features % size == 0 and wanted % size == 0:
            return size
    raise ValueError(f"int4: no group size in {KERNEL_GROUP_SIZES} divides in_features={in_features} and {wanted}")


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] → (q int32 [N, K] in 0..15, scale [K/g, N], zero [K/g, N]), asymmetric min/max per group."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=1e-10)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    zero = low + 8 * scale  # q = 0 decodes to the group's minimum
    return q.reshape(n, k), scale.t().contiguous(), zero.t().contiguous()


@functools.cache
def cpu_pack_layout() -> tuple[int, bool]:
    """(block, split): how `_convert_weight_to_int4pack_for_cpu` lays out output channels in this process.

    The layout follows the ATen CPU kernel that torch dispatches to (ATEN_CPU_CAPABILITY, or the CPU's best),
    not the torch version: AVX512 packs blocks of 64 channels, AVX2 blocks of 32, both split in halves; the
    non-vectorized kernel (DEFAULT, MSVC builds, non-x86) pairs neighbours in blocks of 32 (int4mm_kernel.cpp,
    `weight_to_int4pack_kernel`). Found once by packing a probe and keeping the candidate that unpacks it."""
    probe = torch.randint(0, 16, (64 + 16, 4), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    for layout in _CPU_PACK_LAYOUTS:
        if torch.equal(_unpack_int4_layout(packed, *probe.shape, *layout), probe):
            return layout
    raise RuntimeError(f"int4: unknown layout from _convert_weight_to_int4pack_for_cpu (torch {torch.__version__})")


def _unpack_int4_layout(packed: torch.Tensor, n: int, k: int, block: int, split: bool) -> torch.Tensor:
    """Output channels in blocks of `block` (a last one of n % block), each stored [K, channels/2] bytes: a full
    block with `split` holds channel j in byte j's low nibble and j + block/2 in its high one; any other block
    holds channels 2j and 2j + 1 in byte j's low and high nibbles."""
    flat = packed.reshape(-1).to(torch.int32)
    full = n // block * block
    main = flat[: full * k // 2].view(full // block, k, block // 2)
    halves = [main & 0xF, main >> 4]
    nibbles = torch.cat(halves, dim=-1) if split else torch.stack(halves, dim=-1).reshape(-1, k, block)
    q = nibbles.permute(0, 2, 1).reshape(full, k)
    if full == n:
        return q
    tail = flat[full * k // 2 :].view(k, (n - full) // 2)
    tail = torch.stack([tail & 0xF, tail >> 4], dim=-1).reshape(k, n - full).t()
    return torch.cat([q, tail])


def unpack_int4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of `_convert_weight_to_int4pack_for_cpu`: packed [N, K/2] uint8 → q int32 [N, K].

    The layout is not fixed: `_convert_weight_to_int4pack_for_cpu` packs for the CPU kernel torch dispatches to
    (blocks of 64 channels under AVX512, 32 under AVX2, neighbour pairs without vectorization), and its matmul
    reads that back; a fixed AVX2 inverse decoded AVX512 packs into the wrong channels (`cpu_pack_layout`).
    """
    return _unpack_int4_layout(packed, n, k, *cpu_pack_layout())


def native_group_size(weight: torch.Tensor) -> int | None:
    """32 or 64 when the weight already lies on a 4-bit min/max grid with groups of that size (a 4-bit
    checkpoint dequantized, e.g. the bundled Q4_1 GGUF): quantizing with that group size is then lossless,
    where a coarser group would round the grid again (measured on the bundled model: mean KL to float32
    0.0006 with groups of 32, 0.63 with 64). A sample of 16 rows decides."""
    sample = weight[:16].float()
    for size in (32, 64):
        if sample.shape[1] % size:
            continue
        q, scale, zero = quantize_int4(sample, size)
        rebuilt = ((q.view(q.shape[0], -1, size) - 8) * scale.t()[..., None] + zero.t()[..., None]).view_as(sample)
        steps = scale.t().repeat_interleave(size, dim=1)
        if ((rebuilt - sample).abs() <= 0.01 * steps).all():
            return size
    return None


def default_cuda_kernel() -> str:
    """The int4 kernel on CUDA, chosen once per layer: `KETTLE_TUNING`'s `cuda-int4-kernel` (tinygemm by default;
    triton where Triton is installed)."""
    wanted = settings.current().cuda_int4_kernel
    return "triton" if wanted == "triton" and int4_cuda.triton is not None else "tinygemm"


class Int4Linear(nn.Module):
    """y = x Wᵀ (+ b) with W [out, in] group-wise int4; same call shape as `kettle.layers.linear.Linear`."""

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        group_size: int,
        bias: torch.Tensor | None = None,
        act_dtype: torch.dtype = KERNEL_ACT_DTYPE,
        cuda_kernel: str | None = None,
    ) -> None:
        super().__init__()
        n, k = q.shape
        if n % 16:
            raise ValueError(f"int4: out_features must be a multiple of 16 for the packed kernel, got {n}")
        self.out_features, self.in_features, self.group_size = int(n), int(k), group_size
        self.on_cuda = q.is_cuda
        self.cuda_kernel = (cuda_kernel or default_cuda_kernel()) if self.on_cuda else None
        self.act_dtype = torch.bfloat16 if self.on_cuda else act_dtype  # tinygemm computes in bfloat16 only
        self.dense_rows = int4_cuda.MAX_ROWS if self.cuda_kernel == "triton" else DENSE_ROWS
        if self.cuda_kernel == "triton":
            packed = int4_cuda.pack_pairs(q)
        elif self.on_cuda:
            packed = pack_int4_cuda(q.to(torch.int32))
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.register_buffer("packed", packed, persistent=False)
        scale_zero = torch.stack([scale, zero], dim=-1).to(self.act_dtype).contiguous()
        self.register_buffer("scale_zero", scale_zero, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    @classmethod
    def from_weight(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int | None = 128, **kwargs
    ) -> Int4Linear:
        """Quantizes a dense [out, in] weight with groups of `group_size` (or the largest kernel size dividing it);
        `group_size=None` keeps a weight's own 4-bit grid (`native_group_size`), else uses 128."""
        wanted = group_size or native_group_size(weight) or DEFAULT_INT4_GROUP_SIZE
        size = kernel_group_size(weight.shape[1], wanted)
        q, scale, zero = quantize_int4(weight, size)
        return cls(q, scale, zero, size, bias, **kwargs)

    @classmethod
    def from_qparams(
        cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, bias=None
    ) -> Int4Linear:
        """From q [N, K] (0..15) and scale/zero [K/g, N] in the float-zero form; a group size the kernel lacks
        is split into kernel-sized groups sharing its scale and zero (an exact rewrite)."""
        size = kernel_group_size(q.shape[1], group_size)
        repeat = group_size // size
        return cls(q, scale.repeat_interleave(repeat, 0), zero.repeat_interleave(repeat, 0), size, bias)

    def dequantized(self) -> torch.Tensor:
        """W as a dense float32 [out, in] tensor (for large prefills and for checks)."""
        q = self._unpacked().float()
        scale, zero = self.scale_zero.float().unbind(-1)  # [K/g, N] each
        groups = (q.view(self.out_features, -1, self.group_size) - 8) * scale.t()[..., None] + zero.t()[..., None]
        return groups.view(self.out_features, self.in_features)

    def _unpacked(self) -> torch.Tensor:
        """q [out, in] in 0..15 from the kernel's layout."""
        if self.cuda_kernel == "triton":
            return int4_cuda.unpack_pairs(self.packed)
        unpack = unpack_int4_cuda if self.on_cuda else unpack_int4
        return unpack(self.packed, self.out_features, self.in_features)

    def _cuda_dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """W in `dtype` [out, in] on the GPU, for one large call (addcmul rounds once, in `dtype`)."""
        if self.cuda_kernel == "triton":
            return int4_cuda.dense_weight(self.packed, self.scale_zero, self.group_size, dtype)
        n, k = self.out_features, self.in_features
        q = unpack_int4_cuda(self.packed, n, k).view(n, -1, self.group_size).to(dtype) - 8
        # [N, K/g, 1] each, contiguous: the output then takes q's (contiguous) layout, not the scales' transposed one.
        scale, zero = (t.t().contiguous().unsqueeze(-1) for t in self.scale_zero.to(dtype).unbind(-1))
        return torch.addcmul(zero, q, scale).reshape(n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.on_cuda and rows.shape[0] > self.dense_rows:
            y = F.linear(rows, self._cuda_dense_weight(rows.dtype))
        elif self.cuda_kernel == "triton":
            half = rows if rows.dtype in (torch.bfloat16, torch.float16) else rows.to(torch.bfloat16)
            y = int4_cuda.int4_matmul(half, self.packed, self.scale_zero, self.group_size).to(x.dtype)
        elif self.on_cuda:
            y = torch.ops.aten._weight_int4pack_mm(
                rows.to(torch.bfloat16).contiguous(), self.packed, self.group_size, self.scale_zero
            ).to(x.dtype)
        elif rows.shape[0] > self.dense_rows:
            y = F.linear(rows.float(), self.dequantized()).to(x.dtype)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows.to(self.act_dtype), self.packed, self.group_size, self.scale_zero
            ).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
            if self.on_cuda:  # the float32 bias must not promote a bfloat16 model's activations
                y = y.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kernel = f", kernel={self.cuda_kernel}" if self.cuda_kernel else ""
        return f"in={self.in_features}, out={self.out_features}, group_size={self.group_size}{kernel}"
