"""The CUDA attention backend: a Triton paged-decode kernel that reads K/V through the block table.

Decode attention is memory-bound and, at small batch, latency-bound: a gather of each sequence's blocks
into a padded copy (what the SDPA backend does) reads and writes the whole context once more, and its shape
changes with the longest context, which rules out CUDA graphs. This kernel reads K/V in place, slot by slot
through the block table, and stops at each sequence's own length (read from a tensor), so every launch
has the same shape whatever the contexts are: decode steps can be captured once and replayed.

Work is split over (query head, sequence, context split). With few sequences, one program per head would
leave most of the GPU idle, so the context is cut into `splits` parts attended independently (flash-decoding)
and merged by a second small kernel; the split count depends only on the batch shape, never on the data.
The head is the grid's first axis, the one the GPU walks fastest, as vLLM's paged attention lays it out: the
query heads that share a KV head run side by side and read its K/V tiles while they are in L2. With the
sequence first, at 256 sequences they ran 256 programs apart, and the ~90 MB read in between (Llama-3.1-8B,
~700-token contexts) would have evicted a 50-60 MB L2, so each KV head was read from memory once per query head.

In a decode-only step the kernel also writes the new token's K/V into its slot (it attends to them from the
projections directly), which saves the two cache-write launches per layer.

The cache may be in another dtype than the model's (`--kv-cache-dtype`): float8 (e4m3fn or e5m2, on GPUs
of compute capability 8.9 or newer) or a 16-bit type. The kernel widens K/V to float32 as it reads them and
rounds the new token's K/V to the cache's dtype, saturating for float8, before it attends to them.

Prefills (whole or chunked, over a cached prefix or not) take one varlen launch of the paged prefill kernel
(cuda_prefill.py) per layer. Only what these kernels lack goes to the SDPA backend: ALiBi, soft-capping, and
prefills with spans attended both ways (Gemma 3's images). Tensors not on CUDA go to the SDPA backend too, so
selecting this backend never breaks the CPU path, unless Triton's interpreter is on (TRITON_INTERPRET=1): then
the kernels run on CPU tensors, which is how the tests check them without a GPU.
"""

from __future__ import annotations

import torch

from kettle.layers import cuda_prefill
from kettle.layers.attention import AttentionMetadata, DecodePlan
from kettle.layers.sdpa_attention import SdpaBackend
from kettle.layers.triton_support import INTERPRET, tl, triton, tuning
from kettle.tensors.kv_cache import FLOAT8_MAX

# Programs wanted in flight per decode launch: a few per SM on an H100 (132 SMs), so small batches still
# spread their context over the whole chip. The interpreter runs programs one at a time in Python: it aims at
# fewer, so its tests take seconds, and small batches still split their contexts.
TARGET_PROGRAMS = 32 if INTERPRET else 512
MAX_SPLITS = 16
NO_WINDOW = 1 << 30


if triton is not None:
    # Tile height and warps are tuned once per batch-size class (the split count follows from it) on first use;
    # warm-up steps run before any graph capture, so tuning never happens inside one, and the graphs' buckets
    # reach every class, so eager steps (mixed with prefills) find their class tuned.
    @triton.autotune(
        configs=tuning(("BLOCK_N",), [(32, 4), (64, 4), (64, 8), (128, 4), (128, 8)]),
        key=["batch_class", "SPLITS", "HEAD_DIM"],
    )
    @triton.jit
    def _decode_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, pos_ptr, out_ptr, part_ptr, stats_ptr,
        k_new_ptr, v_new_ptr, slots_ptr,
        stride_qt, stride_qh, stride_kv_slot, stride_kv_head, stride_table, stride_ot, stride_oh,
        stride_knt, stride_knh, stride_vnt, stride_vnh,
        scale, window, head_dim, batch_class,
        GROUP: tl.constexpr, SPLITS: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
        WRITE_NEW: tl.constexpr, KV_MAX: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        head, seq, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        kv_head = head // GROUP
        last = tl.load(pos_ptr + seq)  # the new token's position
        seq_len = last + 1
        first = tl.maximum(seq_len - window, 0)  # `window` is huge when there is none
        # Each split takes a whole number of BLOCK_N tiles of this sequence's own context.
        per_split = tl.cdiv(tl.cdiv(seq_len - first, SPLITS), BLOCK_N) * BLOCK_N
        lo = first + split * per_split
        hi = tl.minimum(lo + per_split, seq_len)
        d = tl.arange(0, HEAD_DIM)
        d_ok = d < head_dim
        q = tl.load(q_ptr + seq * stride_qt + head * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32) * scale
        cached_end = hi
        if WRITE_NEW:
            # The new token's K/V come from the projections, not the cache: one program per KV head writes
            # them into their slot, and no program reads that slot, so there is no race.
            k_last = tl.load(k_new_ptr + seq * stride_knt + kv_head * stride_knh + d, mask=d_ok, other=0.0)
            v_last = tl.load(v_new_ptr + seq * stride_vnt + kv_head * stride_vnh + d, mask=d_ok, other=0.0)
            if KV_MAX > 0:
                # A float8 cache: saturate as `to_cache_dtype` does (an out-of-range cast is NaN or infinity).
                k_last = tl.minimum(tl.maximum(k_last.to(tl.float32), -KV_MAX), KV_MAX)
                v_last = tl.minimum(tl.maximum(v_last.to(tl.float32), -KV_MAX), KV_MAX)
            # Rounded to the cache's dtype before use too (a no-op when it is the model's), so this token is
            # attended with the values every later step will read back, as the SDPA path does.
            k_last = k_last.to(k_ptr.dtype.element_ty)
            v_last = v_last.to(v_ptr.dtype.element_ty)
            if (split == 0) & (head % GROUP == 0):
                slot = tl.load(slots_ptr + seq).to(tl.int64) * stride_kv_slot + kv_head * stride_kv_head
                tl.store(k_ptr + slot + d, k_last, mask=d_ok)
                tl.store(v_ptr + slot + d, v_last, mask=d_ok)
            cached_end = tl.minimum(hi, last)
        m_i = -float("inf")
        l_i = 0.0
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            valid = n < hi
            cached = n < cached_end
            page = tl.load(table_ptr + seq * stride_table + n // PAGE, mask=cached, other=0)
            rows = (page * PAGE + n % PAGE).to(tl.int64) * stride_kv_slot + kv_head * stride_kv_head
            tile_ok = cached[:, None] & d_ok[None, :]
            # K and V loads issued together, so both are in flight while the scores are computed.
            k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=tile_ok, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=tile_ok, other=0.0).to(tl.float32)
            if WRITE_NEW:
                is_new = (n == last)[:, None]
                k = tl.where(is_new, k_last.to(tl.float32)[None, :], k)
                v = tl.where(is_new, v_last.to(tl.float32)[None, :], v)
            s = tl.where(valid, tl.sum(k * q[None, :], 1), -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            l_i = l_i * alpha + tl.sum(p, 0)
            m_i = m_new
        if SPLITS == 1:
            out = acc / l_i
            tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)
        else:
            # Unnormalised partial result plus its running max and sum, merged by _merge_kernel.
            row = (seq * tl.num_programs(0) + head) * SPLITS + split
            tl.store(part_ptr + row * HEAD_DIM + d, acc)
            tl.store(stats_ptr + row * 2, m_i)
            tl.store(stats_ptr + row * 2 + 1, l_i)

    @triton.jit
    def _merge_kernel(
        part_ptr, stats_ptr, out_ptr, stride_ot, stride_oh, head_dim,
        SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):  # fmt: skip
        head, seq = tl.program_id(0), tl.program_id(1)
        row0 = (seq * tl.num_programs(0) + head) * SPLITS
        s = tl.arange(0, SPLITS)
        m = tl.load(stats_ptr + (row0 + s) * 2)
        l_s = tl.load(stats_ptr + (row0 + s) * 2 + 1)
        # Empty splits carry m = -inf and weigh exactly 0; split 0 is never empty, so m_max is finite.
        m_max = tl.max(m, 0)
        w = tl.exp(m - m_max)
        d = tl.arange(0, HEAD_DIM)
        part = tl.load(part_ptr + (row0 + s)[:, None] * HEAD_DIM + d[None, :])
        out = tl.sum(part * w[:, None], 0) / tl.sum(l_s * w, 0)
        tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < head_dim)


def num_splits(num_seqs: int, num_heads: int) -> int:
    """Context splits per (sequence, head): a power of two that fills the GPU for `num_seqs` sequences (callers pass
    the batch's class, a power of two); depends on shape only."""
    splits = 1
    while splits < MAX_SPLITS and num_seqs * num_heads * splits < TARGET_PROGRAMS // 2:
        splits *= 2
    return splits


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q [N, H, D] (one token per sequence at `positions` [N]) → [N, H, D], attending over slots 0..position
    of each sequence through `block_table` [N, width]. With `new_kv` = (k_new, v_new [N, Hkv, D], slots [N]),
    the kernel also writes the new token's K/V into the cache; without, they must already be there."""
    num_seqs, num_heads, head_dim = q.shape
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    # From the class, not the count: 3 sequences split as 4 do, so a step of any size runs a (class, splits) pair
    # that the graphs' warm-ups tuned.
    batch_class = min(triton.next_power_of_2(num_seqs), 256)
    splits = num_splits(batch_class, num_heads)
    padded_dim = triton.next_power_of_2(head_dim)
    part = stats = out  # unused when there is one split
    if splits > 1:
        part = torch.empty(num_seqs * num_heads * splits, padded_dim, dtype=torch.float32, device=q.device)
        stats = torch.empty(num_seqs * num_heads * splits, 2, dtype=torch.float32, device=q.device)
    table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    k_new, v_new, slots = new_kv if new_kv is not None else (k_cache, v_cache, positions)
    _decode_kernel[(num_heads, num_seqs, splits)](
        q, k_cache, v_cache, table, positions, out, part, stats, k_new, v_new, slots,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), table.stride(0), out.stride(0), out.stride(1),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        scale, sliding_window or NO_WINDOW, head_dim, batch_class,
        GROUP=num_heads // k_cache.shape[1], SPLITS=splits, PAGE=block_size, HEAD_DIM=padded_dim,
        WRITE_NEW=new_kv is not None, KV_MAX=FLOAT8_MAX.get(k_cache.dtype, 0.0),
    )  # fmt: skip
    if splits > 1:
        _merge_kernel[(num_heads, num_seqs)](
            part, stats, out, out.stride(0), out.stride(1), head_dim, SPLITS=splits, HEAD_DIM=padded_dim, num_warps=1
        )
    return out


def runs_triton(q: torch.Tensor) -> bool:
    """Whether the Triton kernels take `q`'s attention: on CUDA, or anywhere under Triton's interpreter."""
    return triton is not None and (q.is_cuda or INTERPRET)


class CudaBackend(SdpaBackend):
    """Triton paged decode and prefill on CUDA tensors; SDPA for what they lack and for anything not on CUDA."""

    name = "cuda"

    def forward(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        alibi_slopes: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Decode-only steps in one kernel (cache write included); anything else as the SDPA backend does it.

        A chained step (speculation's rows, which read each other's new K/V) writes first, then decodes: in one
        launch a row could read a slot before the program that writes it has run.

        The Triton kernel has no ALiBi or soft-capping: layers that need them (BLOOM, MPT, Falcon-alibi,
        Gemma 2) run on the SDPA path, which `decode` below hands back to when either is set.
        """
        plain = alibi_slopes is None and softcap is None
        if not (runs_triton(q) and meta.decode_only and not meta.chained and plain):
            mods = (alibi_slopes, softcap)
            return super().forward(q, k_new, v_new, k_cache, v_cache, meta, scale, sliding_window, *mods)
        plan = meta.decode
        table = plan.block_ids.view(q.shape[0], plan.num_blocks)
        positions, new_kv = plan.query_positions.view(-1), (k_new, v_new, meta.slots)
        return paged_decode(q, k_cache, v_cache, table, positions, meta.block_size, scale, sliding_window, new_kv)

    def _prefills_into(self, out, q, k_new, v_new, k_cache, v_cache, meta: AttentionMetadata, scale, window, mods):
        """Every prefill in one launch of the paged prefill kernel (their K/V are in the cache by now)."""
        if not meta.prefills:
            return
        if not runs_triton(q) or any(m is not None for m in mods) or any(plan.spans for plan in meta.prefills):
            super()._prefills_into(out, q, k_new, v_new, k_cache, v_cache, meta, scale, window, mods)
            return
        batch = meta.prefill_batch()
        cuda_prefill.paged_prefill(q, k_cache, v_cache, batch, meta.block_size, scale, window, out)

    @staticmethod
    def decode(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: DecodePlan,
        block_size: int,
        scale: float,
        sliding_window: int | None,
        alibi_slopes: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """The SDPA backend's decode call, served by the Triton kernel when the tensors are on CUDA (and no
        ALiBi or soft-capping is asked for, which only the SDPA path implements)."""
        if not runs_triton(q) or alibi_slopes is not None or softcap is not None:
            mods = (alibi_slopes, softcap)
            return SdpaBackend.decode(q, k_cache, v_cache, plan, block_size, scale, sliding_window, *mods)
        table = plan.block_ids.view(q.shape[0], plan.num_blocks)
        return paged_decode(
            q, k_cache, v_cache, table, plan.query_positions.view(-1), block_size, scale, sliding_window
        )
