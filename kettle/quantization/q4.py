"""Group-wise int4 weight-only linear layers on Kettle's own CPU kernel (kettle/kernels/cpu_kernels.c).

The same quantization as `Int4Linear` (w = (q - 8) · scale + zero per group of input channels), stored for a
kernel that takes float32 activations: PyTorch's packed int4 kernel is fast only with bfloat16 activations on
AVX2, which costs two casts per call and rounds the activations (measured in bench/quant_kernels.py). Each
row keeps its nibbles in chunks of 64 input channels (byte j holds channels j and j + 32, so one 32-byte load
gives 32 weights in order) and a float16 scale and minimum per group, 0.5625 bytes a weight at group size 64 (a
symmetric weight, GGUF's Q4_0, stores no minimums: `from_groups`).

Used for `--quantize int4` (and GPTQ/AWQ checkpoints) on the CPU when the kernels build here
(`kettle.kernels.ops.available()`); `KETTLE_CPU_KERNELS=0` selects `Int4Linear` instead.
"""

from __future__ import annotations

import torch
from torch import nn

from kettle.kernels import ops
from kettle.quantization.config import DEFAULT_INT4_GROUP_SIZE, DENSE_ROWS
from kettle.quantization.int4 import kernel_group_size, native_group_size, quantize_int4

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


class Q4Linear(nn.Module):
    """y = x Wᵀ (+ b) with W [out, in] group-wise int4 on Kettle's CPU kernel; same call shape as `Linear`."""

    def __init__(
        self, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int, bias=None
    ) -> None:
        """From the stored form: packed [N, K/2] uint8 (`pack_q4`), scales and minimums [N, K/g] (rounded to
        float16; `mins` None: a symmetric weight, minimum -8 · scale)."""
        super().__init__()
        n, k = packed.shape[0], packed.shape[1] * 2
        if k % group_size or group_size % BLOCK or k % CHUNK:
            raise ValueError(f"int4: in_features {k} must be a multiple of {CHUNK}, group size {group_size} of {BLOCK}")
        self.out_features, self.in_features, self.group_size = int(n), int(k), group_size
        self.dense_rows = DENSE_ROWS
        self.register_buffer("packed", packed.to(torch.uint8).contiguous(), persistent=False)
        self.register_buffer("scales", scales.to(torch.float16).contiguous(), persistent=False)
        minimums = None if mins is None else mins.to(torch.float16).contiguous()
        self.register_buffer("mins", minimums, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)

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

    def minimums(self) -> torch.Tensor:
        """The float16 minimum of every group, [N, K/g] (a symmetric weight's -8 · scale)."""
        return -8 * self.scales if self.mins is None else self.mins

    def dequantized(self) -> torch.Tensor:
        """W as a dense float32 [out, in] tensor, exactly what the kernel multiplies by."""
        if ops.available():  # one parallel C pass; the tensor ops below cost ~10x more per prefill chunk
            return ops.q4_dequantize(self.packed, self.scales, self.mins, self.group_size)
        q = unpack_q4(self.packed).float().view(self.out_features, -1, self.group_size)
        weight = q * self.scales.float()[..., None] + self.minimums().float()[..., None]
        return weight.view(self.out_features, self.in_features)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W in float32, the values the kernels multiply by: the embedding lookup of a GGUF file's
        4-bit table, which then needs no float32 copy (a 1.1B model's: 250 MiB). Only loaded where the kernels are
        (`GgufScheme`), as `forward` runs on them."""
        rows = ops.q4_rows(self.packed, self.scales, self.mins, self.group_size, ids)
        return rows.view(*ids.shape, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        # Every row count runs on the kernels: prompt chunks on the panel GEMM, which never dequantizes the whole
        # weight (`ops.GEMM_ROWS`).
        y = ops.q4_linear(rows.float(), self.packed, self.scales, self.mins, self.group_size, self.bias)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, group_size={self.group_size}, kernel=kettle"
