"""The default attention backend: PyTorch's scaled_dot_product_attention over gathered KV blocks.

Runs on any device (it is the CPU path; CUDA gets dedicated varlen/paged kernels later). Contexts are read
from the paged cache at block granularity with one `index_select` per call: measured on CPU, gathering whole
blocks is 1.3–3x faster than gathering single slots, and the padding it adds is masked out.

Grouped-query attention in decode avoids repeating K/V altogether: the G query heads that share a KV head
are laid out as G query rows of that head, so one SDPA call sees [Nd, Hkv, G, D] against [Nd, Hkv, L, D].

On the CPU, float32 decodes and prefills without score modifiers go to Kettle's kernels instead
(`kettle_paged_decode`, `kettle_paged_prefill`), which read the K/V in place through the block tables, and the
new K/V go into their slots in one C call.

The cache may hold K/V in another dtype than the model's (`--kv-cache-dtype`, e.g. float16 under a float32
model, or float8 on CUDA): the kernels widen it as they read; here the new K/V are cast on write and the
gathered context is cast back to the queries' dtype on read. Every path attends to the K/V as the cache holds
them, the new tokens' included, so a cached prefix and a fresh one give the same result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kettle.kernels import ops
from kettle.layers.attention import AttentionMetadata, DecodePlan, PrefillPlan, window_mask
from kettle.tensors.kv_cache import FLOAT8, to_cache_dtype, write_slots


def gather_blocks(
    cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int, block_size: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """[num_seqs, blocks_per_seq * block_size, Hkv, D] contexts read from a flat [slots, Hkv, D] cache, in `dtype`
    when given (a no-op when the cache already is). A float8 cache is read through a byte view, as it is written."""
    source = cache.view(torch.uint8) if cache.dtype in FLOAT8 else cache
    blocks = source.view(-1, block_size, *cache.shape[1:])
    gathered = blocks.index_select(0, block_ids).view(num_seqs, -1, *cache.shape[1:]).view(cache.dtype)
    return gathered if dtype is None else gathered.to(dtype)


class SdpaBackend:
    """Writes the new K/V into their slots, then attends with SDPA: decodes batched, prefills one by one."""

    name = "sdpa"

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
        if ops.cache_write_fits(k_new, v_new, k_cache, v_cache):
            ops.cache_write(k_new, v_new, meta.slots, k_cache, v_cache)
        else:
            # Rounds to nearest-even into a 16-bit cache, as the C write does (float8 saturates); no cast when
            # the dtypes match.
            write_slots(k_cache, meta.slots, k_new)
            write_slots(v_cache, meta.slots, v_new)
        mods = (alibi_slopes, softcap)
        if meta.decode_only:
            return self.decode(q, k_cache, v_cache, meta.decode, meta.block_size, scale, sliding_window, *mods)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self._prefills_into(out, q, k_new, v_new, k_cache, v_cache, meta, scale, sliding_window, mods)
        if meta.decode is not None:
            self._decode_into(out, q, k_cache, v_cache, meta, scale, sliding_window, mods)
        return out

    def _prefills_into(self, out, q, k_new, v_new, k_cache, v_cache, meta: AttentionMetadata, scale, window, mods):
        """Each prefill's rows of `out`, one call per prefill (their K/V are already in the cache)."""
        for plan in meta.prefills:
            rows = out[plan.start : plan.end]
            result = self.prefill(
                q, k_new, v_new, k_cache, v_cache, plan, meta.block_size, scale, window, *mods, out=rows
            )
            if result is not rows:  # the CPU kernel writes in place; SDPA's result is copied
                rows.copy_(result)

    def _decode_into(self, out, q, k_cache, v_cache, meta: AttentionMetadata, scale, sliding_window, mods) -> None:
        """Decodes mixed with prefills: slice when their tokens are contiguous, index otherwise."""
        plan, block_size = meta.decode, meta.block_size
        if plan.token_range is not None:
            start, end = plan.token_range
            out[start:end] = self.decode(q[start:end], k_cache, v_cache, plan, block_size, scale, sliding_window, *mods)
            return
        q_dec = q.index_select(0, plan.token_indices)
        result = self.decode(q_dec, k_cache, v_cache, plan, block_size, scale, sliding_window, *mods)
        out.index_copy_(0, plan.token_indices, result)

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
        """q [Nd, H, D] (one token per sequence) → [Nd, H, D], in one SDPA call (or Kettle's CPU kernel)."""
        num_seqs, num_heads, head_dim = q.shape
        if alibi_slopes is None and softcap is None and _cpu_kernel_fits(q, k_cache, v_cache):
            # Reads each sequence's K/V in place: no gathered copy of every context, no padded mask.
            tables = plan.block_ids.view(num_seqs, plan.num_blocks)
            positions = plan.query_positions.view(num_seqs)
            return ops.paged_decode(q, k_cache, v_cache, tables, positions, block_size, scale, sliding_window)
        num_kv_heads = k_cache.shape[1]
        k = gather_blocks(k_cache, plan.block_ids, num_seqs, block_size, q.dtype).transpose(1, 2)
        v = gather_blocks(v_cache, plan.block_ids, num_seqs, block_size, q.dtype).transpose(1, 2)
        grouped = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        if alibi_slopes is None and softcap is None:
            out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=plan.mask(sliding_window), scale=scale)
        else:
            # Slopes laid out like the grouped queries: [1, Hkv, G, 1] against positions [Nd, 1, 1, L].
            slopes = None if alibi_slopes is None else alibi_slopes.view(1, num_kv_heads, -1, 1)
            out = modified_attention(grouped, k, v, plan, sliding_window, scale, slopes, softcap)
        return out.reshape(num_seqs, num_heads, head_dim)

    @staticmethod
    def prefill(
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: PrefillPlan,
        block_size: int,
        scale: float,
        sliding_window: int | None,
        alibi_slopes: torch.Tensor | None = None,
        softcap: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One sequence's new tokens → [L, H, D]; causal over its whole context (cached prefix included), its
        `spans` both ways (SDPA with the plan's mask). The CPU kernel writes into `out` (contiguous [L, H, D]) when
        given; the other paths return a new tensor."""
        plain = alibi_slopes is None and softcap is None and not plan.spans  # spans: the masked path below
        if plain and _prefill_kernel_fits(q, k_cache, v_cache, block_size):
            # Kettle's flash-style kernel reads the context in place: no gathered copy, no [L, context] mask.
            return ops.paged_prefill(
                q[plan.start : plan.end], k_cache, v_cache, plan.block_ids, plan.cache_len, block_size, scale,
                sliding_window, out,
            )  # fmt: skip
        if plan.cache_len:
            k = gather_blocks(k_cache, plan.block_ids, 1, block_size, q.dtype)[0]
            v = gather_blocks(v_cache, plan.block_ids, 1, block_size, q.dtype)[0]
        else:
            # Nothing cached: the new K/V are the whole context, no gather needed. Under a narrower cache they
            # are rounded as the cache holds them, so a prompt is attended alike whether a prefix of it came from
            # the prefix cache or not (and as Kettle's kernels, which read them back from the cache, attend it).
            k, v = k_new[plan.start : plan.end], v_new[plan.start : plan.end]
            if k_cache.dtype != q.dtype:
                k, v = to_cache_dtype(k, k_cache.dtype).to(q.dtype), to_cache_dtype(v, v_cache.dtype).to(q.dtype)
        if alibi_slopes is not None or softcap is not None:
            return _modified_prefill(q[plan.start : plan.end], k, v, plan, sliding_window, scale, alibi_slopes, softcap)
        mask = plan.mask(sliding_window) if plan.needs_mask(sliding_window) else None
        # A batch dimension of 1: on the CPU, SDPA takes its flash kernel only for 4-D inputs; 3-D ones go to the
        # math path, which builds the whole [H, L, L] score matrix (1,000 tokens: 6x slower, 60% of a prefill).
        out = F.scaled_dot_product_attention(
            q[plan.start : plan.end].transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out[0].transpose(0, 1)


def _cpu_kernel_fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether Kettle's CPU decode kernel takes these tensors (float32 queries; float32, float16 or bfloat16
    caches on the CPU, contiguous as KVCache allocates them; kernels built and on)."""
    return ops.kv_fits(q, k_cache, v_cache)


def _prefill_kernel_fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int) -> bool:
    """Whether Kettle's CPU prefill kernel takes these tensors (`KETTLE_TUNING=prefill-attention=off`: SDPA)."""
    return ops.prefill_attention() and ops.paged_prefill_fits(q, k_cache, v_cache, block_size)


def _modified_prefill(q, k, v, plan: PrefillPlan, window, scale, alibi_slopes, softcap) -> torch.Tensor:
    """q [L, H, D], k/v [C, Hkv, D] → [L, H, D] with ALiBi and/or soft-capping, grouped as in decode."""
    num_kv_heads, head_dim = k.shape[1], q.shape[2]
    grouped = q.transpose(0, 1).reshape(num_kv_heads, -1, q.shape[0], head_dim)  # [Hkv, G, L, D]
    slopes = None if alibi_slopes is None else alibi_slopes.view(num_kv_heads, -1, 1, 1)
    k, v = k.transpose(0, 1).unsqueeze(1), v.transpose(0, 1).unsqueeze(1)  # [Hkv, 1, C, D]
    out = modified_attention(grouped, k, v, plan, window, scale, slopes, softcap)
    return out.reshape(-1, q.shape[0], head_dim).transpose(0, 1)


def modified_attention(q, k, v, plan: DecodePlan | PrefillPlan, window, scale, slopes, softcap) -> torch.Tensor:
    """Attention with ALiBi (`slopes` shaped to broadcast against q's score rows) and/or Gemma 2 soft-capping.

    The mask is built here on every call rather than cached in the plan: under a CUDA graph the plan's
    positions are static buffers refilled before each replay, so a mask computed at capture would go stale.
    Without soft-capping, SDPA takes the ALiBi bias as a float mask; soft-capping needs the scores
    themselves, so that path computes them explicitly (softmax in float32, like Hugging Face's eager path).
    """
    allowed = window_mask(plan.query_positions, plan.key_positions, window, plan.spans)
    bias = None
    if slopes is not None:
        distance = (plan.key_positions - plan.query_positions).to(slopes.dtype)
        bias = torch.where(allowed, slopes * distance, float("-inf")).to(q.dtype)
    if softcap is None:
        if q.shape[:-2] != k.shape[:-2]:
            k, v = k.expand(*q.shape[:-2], *k.shape[-2:]), v.expand(*q.shape[:-2], *v.shape[-2:])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores + bias if bias is not None else scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
