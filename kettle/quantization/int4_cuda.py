"""Group-wise int4 linear on CUDA in Triton, for batched decode (`KETTLE_TUNING=cuda-int4-kernel=triton`).

PyTorch's tinygemm (`_weight_int4pack_mm`, the default) is a one-sequence kernel: it tiles rows by 16 and reads
the packed weight again for every tile, so 32 sequences cost more than a bf16 GEMV. This kernel puts the rows in a
tensor-core tile instead (`tl.dot`, 16 to 64 rows a program): each weight tile is loaded once per block of rows,
its nibbles are split and interleaved in registers, scaled per group (w = (q - 8) · scale + zero, the same
function as tinygemm's and the CPU kernel's), and multiplied in the activations' dtype with float32 accumulation.

Measured on an H100 (`python -m bench gpu --int4-kernels`, Llama-2-7B's projections; bench/RESULTS.md): 0.82-0.90x of
bf16 from 1 to 32 rows at its best tile, flat, at ~19% of the copy bandwidth, so it beats tinygemm at 32 rows
(0.34-0.36x there), at 16 with a good tile (0.87x against 0.69x; 0.48x with the tile tuned at one row, before
the tuning key held the row bucket) and loses below (2.1-2.4x at one row); it stays opt-in until it reads the
weights faster at one row. Two other versions measured slower at every row count and went: the even and odd
inputs against the low and high nibbles in two products, the scales applied to the sums (0.52 ms at one row, 1.57
at 32, against 0.37-0.39); each byte loaded twice, once per nibble, so the values come out in input order with no
shuffle (1.44 ms).

The weight is kept plainly: `pairs` [N, K/2] uint8, input 2j in the low nibble of byte j and 2j + 1 in the high
one, and `scale_zero` [K/g, N, 2] as tinygemm takes it. `Int4Linear` sends calls of more rows (long prompt
chunks) to cuBLAS over a copy dequantized for the call (`dense_weight`).
"""

from __future__ import annotations

import torch

from kettle.layers.triton_support import tl, triton, tuning

# Rows a call takes on the kernel; more (long prompt chunks) go to cuBLAS over a weight dequantized for the call.
# Measured: 256 rows 1.56 ms on the kernel against 4.30 dequantized; at 1,024 rows the dequantized path takes 4.96 ms,
# which the kernel (linear in the rows past 64) would not beat. The crossover in between was not measured.
MAX_ROWS = 256


def pack_pairs(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15 → [N, K/2] uint8, input 2j in byte j's low nibble and 2j + 1 in its high one."""
    q = q.to(torch.uint8)
    return (q[:, ::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_pairs(pairs: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_pairs`: [N, K/2] uint8 → q [N, K] uint8 in 0..15."""
    return torch.stack([pairs & 0xF, pairs >> 4], dim=-1).view(pairs.shape[0], -1)


def dense_weight(pairs: torch.Tensor, scale_zero: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in `dtype` for one large call (addcmul rounds once, in `dtype`)."""
    q = unpack_pairs(pairs)
    n, k = q.shape
    scale, zero = (t.t().contiguous().unsqueeze(-1) for t in scale_zero.to(dtype).unbind(-1))  # [N, K/g, 1]
    return torch.addcmul(zero, q.view(n, -1, group).to(dtype) - 8, scale).reshape(n, k)


if triton is not None:

    @triton.autotune(
        configs=tuning(
            ("BLOCK_N", "BLOCK_K"),
            [(32, 128, 4, 4), (64, 128, 4, 4), (32, 256, 4, 3), (64, 256, 8, 3), (128, 128, 8, 3), (16, 256, 4, 4)],
        ),
        # M_BUCKET (M rounded up to a power of two): the best tile at one row is not the best at 16, though both
        # run the same 16-row programs (a config tuned at one row measured 0.68 ms at 16 rows, against 0.37).
        key=["N", "K", "M_BUCKET"],
    )
    @triton.jit
    def _int4_kernel(
        x_ptr, w_ptr, sz_ptr, y_ptr, M, N, K, stride_xm, stride_ym, M_BUCKET,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # Axis 0 walks row blocks, so the programs that share a weight tile run next to each other (L2 hits).
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        rb = tl.arange(0, BLOCK_K // 2)
        n_ok = rn < N
        w_rows = w_ptr + rn[:, None].to(tl.int64) * (K // 2)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            x_ok = (rm[:, None] < M) & (kk[None, :] < K)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=x_ok, other=0.0)
            byte = k0 // 2 + rb
            b = tl.load(w_rows + byte[None, :], mask=n_ok[:, None] & (byte[None, :] < K // 2), other=0)
            # [N, K/2] bytes → [N, K] values: (low, high) of byte j are inputs 2j and 2j + 1.
            q = tl.reshape(tl.join(b & 0xF, b >> 4), (BLOCK_N, BLOCK_K)).to(tl.float32) - 8.0
            if GROUP >= BLOCK_K:  # one group per channel in this tile
                at = sz_ptr + ((k0 // GROUP) * N + rn) * 2
                scale = tl.load(at, mask=n_ok, other=0.0).to(tl.float32)
                zero = tl.load(at + 1, mask=n_ok, other=0.0).to(tl.float32)
                w = q * scale[:, None] + zero[:, None]
            else:
                TILE_GROUPS: tl.constexpr = BLOCK_K // GROUP
                g = k0 // GROUP + tl.arange(0, TILE_GROUPS)
                at = sz_ptr + (g[None, :] * N + rn[:, None]) * 2
                g_ok = n_ok[:, None] & (g[None, :] < K // GROUP)
                scale = tl.load(at, mask=g_ok, other=0.0).to(tl.float32)
                zero = tl.load(at + 1, mask=g_ok, other=0.0).to(tl.float32)
                w = tl.reshape(q, (BLOCK_N, TILE_GROUPS, GROUP)) * scale[:, :, None] + zero[:, :, None]
                w = tl.reshape(w, (BLOCK_N, BLOCK_K))
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        y_mask = (rm[:, None] < M) & n_ok[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=y_mask)


def block_rows(rows: int) -> int:
    """Rows a program multiplies: one tensor-core tile of 16 up to 16 rows, else up to 64 (the weight tile is then
    read once per 32 or 64 rows; larger blocks only add registers)."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def int4_matmul(x: torch.Tensor, pairs: torch.Tensor, scale_zero: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] (bf16/fp16, CUDA) @ Wᵀ → [M, N] in x's dtype, W the group-wise int4 weight in `pairs`/`scale_zero`."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, n = x.shape[0], pairs.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block_m = block_rows(rows)
    grid = lambda meta: (triton.cdiv(rows, block_m), triton.cdiv(n, meta["BLOCK_N"]))  # noqa: E731
    bucket = triton.next_power_of_2(rows)
    _int4_kernel[grid](
        x, pairs, scale_zero, y, rows, n, x.shape[1], x.stride(0), y.stride(0), bucket, GROUP=group, BLOCK_M=block_m
    )
    return y
