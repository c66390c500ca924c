"""The CUDA prefill attention: one Triton launch per layer for every prefill of a step, over the paged cache.

A prefill chunk that follows a cached prefix (an earlier chunk, or a prefix-cache hit) must attend to K/V that
live in scattered cache blocks. Through SDPA that costs a gathered copy of the whole context and an explicit
[L, context] mask, which rules out FlashAttention's kernel. This kernel reads K/V in place through each
sequence's block table, as the decode kernel does, and masks causally (and by the sliding window) from
positions, so a chunk over a 4,000-token prefix reads the prefix once and builds no mask.

All prefills of a step go in one launch, laid out varlen (`PrefillBatch`): programs are (prefill, tile of
BLOCK_M queries, query head), and tiles past a prefill's own length return at once. Every prefill takes this
kernel, with a prefix or without, so a prompt is attended by the same code however it was chunked or cached.

It is FlashAttention's forward in its plain form: scores of a [BLOCK_M, BLOCK_N] tile by one `tl.dot`, an online
softmax in float32 (exp2, the scale folded into log2 e), the probabilities rounded to the compute dtype for the
second `tl.dot`. The cache may be float8 or 16-bit (`--kv-cache-dtype`): tiles are widened to the queries'
dtype as they are read. The new tokens' K/V are read back from the cache, where the backend wrote them first,
so they are attended as every later step will read them.
"""

from __future__ import annotations

import torch

from kettle.layers.attention import PrefillBatch
from kettle.layers.triton_support import tl, triton, tuning

NO_WINDOW = 1 << 30
LOG2E = 1.4426950408889634


if triton is not None:
    # Tuned once per model (its head size and group), by the shard's warm-up prefill, the longest chunk it will
    # run: a key with the prompts' lengths in it would tune (and compile five configs) again in the middle of
    # serving at the first prompt of each new length.
    @triton.autotune(
        configs=tuning(
            ("BLOCK_M", "BLOCK_N"), [(64, 64, 4, 2), (128, 64, 8, 3), (128, 64, 4, 2), (64, 32, 4, 2), (128, 128, 8, 2)]
        ),
        key=["HEAD_DIM", "GROUP"],
    )
    @triton.jit
    def _prefill_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, starts_ptr, query_lens_ptr, cache_lens_ptr, table_ptr,
        stride_qt, stride_qh, stride_kv_slot, stride_kv_head, stride_ot, stride_oh, stride_table,
        qk_scale, window, head_dim,
        GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
        PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        seq, tile, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        query_len = tl.load(query_lens_ptr + seq)
        if tile * BLOCK_M >= query_len:
            return  # this prefill is shorter than the step's longest
        start = tl.load(starts_ptr + seq)
        cache_len = tl.load(cache_lens_ptr + seq)
        kv_head = head // GROUP
        m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < query_len
        pos = cache_len + m  # the queries' positions
        d = tl.arange(0, HEAD_DIM)
        d_ok = d < head_dim
        q_rows = (start + m).to(tl.int64)
        # Zeros in the padded head dimensions and rows: a masked load's lanes are otherwise undefined, and a NaN
        # there would reach the scores through the dot.
        q_tile = q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + d[None, :]
        q = tl.load(q_tile, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        # Keys this tile can see: from the first query's window start to the last query's own position.
        hi = tl.minimum(cache_len + (tile + 1) * BLOCK_M, cache_len + query_len)
        lo = tl.maximum(cache_len + tile * BLOCK_M - window + 1, 0)
        # A finite start (not -inf): a row whose keys are all masked in a tile keeps exp2(0) = 1 as its factor
        # instead of NaN, and its first unmasked score then wipes the empty start (exp2(-1e30 - s) = 0).
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        for key0 in range(lo, hi, BLOCK_N):
            n = key0 + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            page = tl.load(table_ptr + seq * stride_table + n // PAGE, mask=n_ok, other=0)
            rows = (page * PAGE + n % PAGE).to(tl.int64) * stride_kv_slot + kv_head * stride_kv_head
            tile_ok = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=tile_ok, other=0.0).to(q.dtype)
            v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=tile_ok, other=0.0).to(q.dtype)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            seen = (n[None, :] <= pos[:, None]) & (n[None, :] > pos[:, None] - window) & n_ok[None, :]
            scores = tl.where(seen, scores, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / tl.where(m_ok, l_i, 1.0)[:, None]
        out_rows = (start + m).to(tl.int64) * stride_ot + head * stride_oh
        tl.store(
            out_ptr + out_rows[:, None] + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=m_ok[:, None] & d_ok[None, :],
        )


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: PrefillBatch,
    block_size: int,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
) -> None:
    """Attends every prefill of `batch` into its rows of `out` ([T, H, D], like q): each query at position p sees
    its sequence's keys at positions ≤ p (and > p - window), read from the caches [slots, Hkv, D] through
    `batch.tables`. The prefills' own K/V must already be in the cache; rows of T outside the prefills are left
    as they are."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    grid = lambda meta: (len(batch.starts), triton.cdiv(batch.max_query_len, meta["BLOCK_M"]), num_heads)  # noqa: E731
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, batch.starts, batch.query_lens, batch.cache_lens, batch.tables,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        batch.tables.stride(0), scale * LOG2E, sliding_window or NO_WINDOW, head_dim,
        GROUP=num_heads // k_cache.shape[1], PAGE=block_size, HEAD_DIM=max(triton.next_power_of_2(head_dim), 16),
        # float32 models: full-precision products (TF32 would round the operands to 10 bits); 16-bit ones: exact.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
