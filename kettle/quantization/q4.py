"""Group-wise int4 weight-only linear layers on Kettle's own CPU kernel (kettle/kernels/cpu_kernels.c).

The same quantization as `Int4Linear` (w = (q - 8) · scale + zero per group of input channels), stored for a
kernel that takes float32 activations: PyTorch's packed int4 kernel is fast only with bfloat16 activations on
AVX2, which costs two casts per call and rounds the activations (`python -m bench decode --vs kernels`). Each
row keeps its nibbles in chunks of 64 input channels (byte j holds channels j and j + 32, so one 32-byte load
gives 32 weights in order) and a float16 scale and minimum per group, 0.5625 bytes a weight at group size 64 (a
symmetric weight, GGUF's Q4_0, stores no minimums: `from_groups`; a Q4_K weight in lanes keeps the file's
6-bit scales as bytes with its super-block scales: `supers`).

Where the kernels run (AVX-512 VNNI, or AVX2 with lanes_avx2.c's tiles), a weight with a multiple of 16 output
channels is stored in lanes instead (`to_lanes`, kernels.h's Q4L layout): 16 channels side by side for each pair
of inputs, so one instruction advances 16 channels by two inputs for a row and several rows share every weight
vector. Same bytes, same values, same kernels' results to float rounding; the bundled model's decode step of 4-8
rows (small batches, a speculative step's verification) ran 1.5-2.3x faster, one row (which reads the weights at
the memory's pace) about the same (docs/performance.md, "Weights in lanes"). On AVX2, with int8 rows, a 1.7B
Q4_K_M file decoded 1.19x faster in lanes than in the rows layout's int16 rows, its prompts 0.93x (lanes_avx2.c).

Used for `--quantize int4` (and GPTQ/AWQ checkpoints) on the CPU when the kernels build here
(`kettle.kernels.ops.available()`); `KETTLE_TUNING=cpu-kernels=off` selects `Int4Linear` instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kettle.kernels import ops
from kettle.kernels.structs import LINEAR_Q4, LINEAR_Q4L, Linear
from kettle.quantization.config import DEFAULT_INT4_GROUP_SIZE, DENSE_ROWS
from kettle.quantization.int4 import kernel_group_size, native_group_size, quantize_int4
from kettle.quantization.kernel_weight import KernelWeight, pointer
from kettle.tensors import huge_pages

if TYPE_CHECKING:
    from kettle.tensors.gguf_file import Blocks

BLOCK = 32  # input channels per activation block and the smallest group
CHUNK = 64  # input channels per 32-byte load of packed weights


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15 → [N, K/2] uint8 with byte j of each 64-chunk = q[j] | q[j + 32] << 4."""
    n, k = q.shape
    chunks = q.to(torch.uint8).view(n, k // CHUNK, 2, CHUNK // 2)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_q4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_q4`: [N, K/2] uint8 → q [N, K] int32."""
    n, half = packed.shape
    chunks = packed.view(n, half // (CHUNK // 2), CHUNK // 2).to(torch.int32)
    return torch.stack([chunks & 0xF, chunks >> 4], dim=2).reshape(n, half * 2)


LANES = 16  # output channels side by side in the lanes layout


def lanes_fit(n: int, group_size: int) -> bool:
    """Whether a weight of n output channels and this group size is stored in lanes (`to_lanes`) here: any group
    of whole blocks of 32 (the kernels' activation blocks), N a multiple of 16."""
    return group_size % BLOCK == 0 and n % LANES == 0 and ops.lanes(LINEAR_Q4L)


def table_to_lanes(table: torch.Tensor) -> torch.Tensor:
    """A per-channel table [N, T] (scales, minimums) → [N/16][T][16]: entry t of 16 channels side by side, as the
    lanes kernels load them (one vector a block or group); same shape."""
    n = table.shape[0]
    return table.view(n // LANES, LANES, -1).transpose(1, 2).reshape(n, -1).contiguous()


def table_from_lanes(table: torch.Tensor) -> torch.Tensor:
    """The inverse of `table_to_lanes`."""
    n = table.shape[0]
    return table.view(n // LANES, -1, LANES).transpose(1, 2).reshape(n, -1).contiguous()


def to_lanes(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """`pack_q4`'s [N, K/2] with scales and minimums [N, K/g] → kernels.h's Q4L layout, in tensors of the same
    shapes: quad vector m of block b of channels 16G.. holds, at byte 4c + 2e + j, inputs 4m + 2j + e (low nibble)
    and 16 + 4m + 2j + e (high) of channel 16G + c; scales and minimums go [N/16][K/g][16]."""
    n, k = packed.shape[0], packed.shape[1] * 2
    chunks = packed.view(n, k // CHUNK, 1, CHUNK // 2)  # one byte a weight from here, never int32 (load time)
    q = torch.cat([chunks & 0xF, chunks >> 4], dim=2).view(n // LANES, LANES, k // BLOCK, 2, 4, 2, 2)
    quads = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 5, 4)  # [G, c, b, m, j, e] → [G, b, m, c, e, j]
    lanes = quads.reshape(n, k // 2).contiguous()
    return lanes, table_to_lanes(scales), None if mins is None else table_to_lanes(mins)


def from_lanes(lanes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The inverse of `to_lanes`."""
    n, k = lanes.shape[0], lanes.shape[1] * 2
    quads = lanes.view(n // LANES, k // BLOCK, 4, LANES, 2, 2).permute(0, 3, 1, 2, 5, 4)  # [G, c, b, m, j, e]
    q = torch.stack([quads & 0xF, quads >> 4], dim=3).reshape(n, k)  # [G, c, b, half, m, j, e]
    return pack_q4(q), table_from_lanes(scales), None if mins is None else table_from_lanes(mins)


SUPER_BLOCK = 256  # input channels per Q4_K super-block: one d and one dmin, 8 sub-blocks' 6-bit sc and m


def q4k_products(sc: torch.Tensor, m: torch.Tensor, supers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's sub-block scales sc and m [N, K/32] with its super-block d and dmin (`supers` [N, K/256, 2]) →
    scales d · sc and minimums -(dmin · m), float32 [N, K/32]: GGUF's own dequantization's products, exact."""
    n = sc.shape[0]
    d, dmin = supers.float().unbind(-1)
    scales = d[..., None] * sc.float().view(n, -1, SUPER_BLOCK // BLOCK)
    mins = -(dmin[..., None] * m.float().view(n, -1, SUPER_BLOCK // BLOCK))
    return scales.view(n, -1), mins.view(n, -1)


class Q4Linear(KernelWeight):
    """y = x Wᵀ (+ b) with W [out, in] group-wise int4 on Kettle's CPU kernel; same call shape as `Linear`."""

    def __init__(
        self,
        packed: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        group_size: int,
        bias=None,
        supers: torch.Tensor | None = None,
    ) -> None:
        """From the stored form: packed [N, K/2] uint8 (`pack_q4`), scales and minimums [N, K/g] (rounded to
        float16; `mins` None: a symmetric weight, minimum -8 · scale). With `supers` [N, K/256, 2] (GGUF Q4_K's
        super-block d and dmin, groups of 32), scales and minimums are Q4_K's 6-bit sc and m, uint8: a weight in
        lanes keeps them so (kernels.h: 148 bytes a channel's 256 weights instead of 160, the products exact);
        any other takes their products rounded to float16 (`q4k_products`)."""
        super().__init__()
        n, k = packed.shape[0], packed.shape[1] * 2
        if k % group_size or group_size % BLOCK or k % CHUNK:
            raise ValueError(f"int4: in_features {k} must be a multiple of {CHUNK}, group size {group_size} of {BLOCK}")
        self.out_features, self.in_features, self.group_size = int(n), int(k), group_size
        self.dense_rows = DENSE_ROWS
        self.lanes = lanes_fit(n, group_size)  # the Q4L layout: the tensors below hold it (`to_lanes`)
        if supers is not None and not (self.lanes and group_size == BLOCK and k % SUPER_BLOCK == 0):
            scales, mins = q4k_products(scales, mins, supers)
            supers = None
        packed = packed.to(torch.uint8).contiguous()
        table = torch.uint8 if supers is not None else torch.float16
        scales = scales.to(table).contiguous()
        minimums = None if mins is None else mins.to(table).contiguous()
        if self.lanes:
            packed, scales, minimums = to_lanes(packed, scales, minimums)
        if supers is not None:  # [N/16][K/256][2][16]: d and dmin of 16 channels side by side, as the kernels load them
            supers = table_to_lanes(supers.to(torch.float16).reshape(n, -1))
        # In 2 MiB pages, as the packed types' (`from_blocks`): `--quantize int4` builds these in tensor ops, and a
        # decode step streams them whole (Q8Linear's requantized weights in 4 KiB pages decoded 1.32x slower).
        self.register_buffer("packed", huge_pages.placed(packed), persistent=False)
        self.register_buffer("scales", huge_pages.placed(scales), persistent=False)
        self.register_buffer("mins", None if minimums is None else huge_pages.placed(minimums), persistent=False)
        self.register_buffer("supers", supers, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)

    @classmethod
    def from_blocks(cls, parts: list[Blocks], bias=None) -> Q4Linear:
        """GGUF Q4_K, Q4_0 or Q4_1 tensors' blocks, all of one type (a fused projection's parts stacked, rows in
        Hugging Face order), packed by the kernels straight from the file's bytes into lanes (`ops.pack`, one pass
        over all threads; decoding and moving them in tensor ops took ~1.5 s of a 1.7B Q4_K_M file's load): Q4_K
        with the file's own scales, Q4_0 with no minimums (`Minimums`), Q4_1 with its own. The caller checks
        `lanes_fit(n, 32)` and, for Q4_K, that the rows are whole super-blocks."""
        n, k, qtype = sum(b.rows for b in parts), parts[0].cols, parts[0].qtype.name
        layer = cls.__new__(cls)
        KernelWeight.__init__(layer)
        layer.out_features, layer.in_features, layer.group_size = n, k, BLOCK
        layer.dense_rows, layer.lanes = DENSE_ROWS, True
        table = torch.uint8 if qtype == "Q4_K" else torch.float16
        tables = {"packed": (k // 2, torch.uint8), "scales": (k // BLOCK, table)}
        tables |= {"mins": (k // BLOCK, table) if qtype != "Q4_0" else None}
        tables |= {"supers": (k // SUPER_BLOCK * 2, torch.float16) if qtype == "Q4_K" else None}
        for name, shape in tables.items():
            tensor = None if shape is None else huge_pages.empty(n, shape[0], dtype=shape[1])
            layer.register_buffer(name, tensor, persistent=False)
        layer.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)
        layer.pack_parts(parts)
        return layer

    def rows_of(self, first: int, count: int) -> Linear:
        """Output channels first .. first + count - 1 (in lanes: multiples of 16) as a weight of their own, without
        bias."""
        rows = slice(first, first + count)
        tensors = (self.packed[rows], self.scales[rows], None if self.mins is None else self.mins[rows], None)
        supers = None if self.supers is None else self.supers[rows]
        kind = LINEAR_Q4L if self.lanes else LINEAR_Q4
        return Linear(kind, self.group_size, count, self.in_features, *map(pointer, tensors), pointer(supers))

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias=None, group_size: int | None = 128) -> Q4Linear:
        """Quantizes a dense [out, in] weight (group_size None: the weight's own 4-bit grid, else 128)."""
        wanted = group_size or native_group_size(weight) or DEFAULT_INT4_GROUP_SIZE
        size = kernel_group_size(weight.shape[1], wanted)  # the same groups as `Int4Linear`
        return cls.from_qparams(*quantize_int4(weight, size), size, bias)

    @classmethod
    def from_qparams(cls, q, scale, zero, group_size: int, bias=None) -> Q4Linear:
        """From q [N, K] (0..15) and scale/zero [K/g, N] in the float-zero form (w = (q - 8) · scale + zero:
        `quantize_int4`, GPTQ/AWQ checkpoints)."""
        scale, zero = scale.float().t(), zero.float().t()  # [N, K/g]
        return cls(pack_q4(q), scale, zero - 8 * scale, group_size, bias)

    @classmethod
    def from_groups(cls, packed, scales, mins, group_size: int, bias=None) -> Q4Linear:
        """From packed values ([N, K/2], `pack_q4`'s layout) and scales/mins [N, K/g] with W = q · scale + min
        (GGUF's 4-bit types): the kernel's float16 scales and minimums are rounded from these directly, not through
        the float-zero form. Where every minimum is -8 · its scale (GGUF's Q4_0, w = d · (q - 8)) none is stored:
        the kernels read the scales for them (kernels.h `Minimums`), exactly, and a one-row step reads 10% fewer
        bytes."""
        scales, mins = scales.to(torch.float16), mins.to(torch.float16)
        symmetric = bool(mins.isfinite().all()) and torch.equal(mins, -8 * scales)
        return cls(packed, scales, None if symmetric else mins, group_size, bias)

    def stored(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """packed [N, K/2], scales and minimums [N, K/g] in the rows layout (`pack_q4`'s; out of lanes); Q4_K's
        scales as their float32 products."""
        packed, scales, mins = from_lanes(self.packed, self.scales, self.mins) if self.lanes else self.tables()
        if self.supers is None:
            return packed, scales, mins
        supers = table_from_lanes(self.supers).view(self.out_features, -1, 2)
        return (packed, *q4k_products(scales, mins, supers))

    def tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """packed, scales and minimums as the kernels read them (in lanes where `lanes`)."""
        return self.packed, self.scales, self.mins

    def dequantized(self) -> torch.Tensor:
        """W as a dense float32 [out, in] tensor, exactly what the kernel multiplies by."""
        if ops.available():  # one parallel C pass; the tensor ops below cost ~10x more per prefill chunk
            return self.kernel_dequantized()
        packed, scales, mins = self.stored()
        q = unpack_q4(packed).float().view(self.out_features, -1, self.group_size)
        minimums = -8 * scales if mins is None else mins
        weight = q * scales.float()[..., None] + minimums.float()[..., None]
        return weight.view(self.out_features, self.in_features)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W in float32, the values the kernels multiply by: the embedding lookup of a GGUF file's
        4-bit table, which then needs no float32 copy (a 1.1B model's: 250 MiB). Only loaded where the kernels are
        (`GgufScheme`), as `forward` runs on them."""
        return self.kernel_embed(ids)

    def describe(self) -> Linear:
        kind = LINEAR_Q4L if self.lanes else LINEAR_Q4
        shape = (self.group_size, self.out_features, self.in_features)
        tensors = (self.packed, self.scales, self.mins, self.bias, self.supers)
        return Linear(kind, *shape, *map(pointer, tensors))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Every row count runs on the kernels: prompt chunks on the panel GEMM, which never dequantizes the whole
        # weight (kettle/kernels/linear.c).
        return self.kernel_forward(x)

    def extra_repr(self) -> str:
        layout = (", lanes" if self.lanes else "") + (", q4_k scales" if self.supers is not None else "")
        return f"in={self.in_features}, out={self.out_features}, group_size={self.group_size}, kernel=kettle{layout}"
