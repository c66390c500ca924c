"""Spans of a prefill attended both ways (Gemma 3's images): the mask is transformers' composition of its
overlays, causal OR the same block, then the sliding window's lower bound (masking_utils: `blockwise_overlay`,
`sliding_window_overlay`); the SDPA backend attends a prefill with spans as dense attention under that mask, with
the prefix cached or not, and a step without spans keeps its causal kernels."""

from __future__ import annotations

import pytest
import torch
from transformers.masking_utils import blockwise_overlay, sliding_window_overlay

from kettle.layers.attention import AttentionMetadata, window_mask
from kettle.layers.sdpa_attention import SdpaBackend

BLOCK = 4


def transformers_mask(length: int, flagged: list[bool], window: int | None) -> torch.Tensor:
    """[length, length] transformers' mask for token types `flagged` (1: an image token)."""
    types = torch.tensor([flagged], dtype=torch.long)
    starts = types & ~torch.nn.functional.pad(types, (1, 0))[:, :-1]
    block_ids = torch.where(types == 1, torch.cumsum(starts, 1) - 1, -1)
    block = blockwise_overlay(block_ids)
    lower = sliding_window_overlay(window) if window else (lambda *args: True)
    rows = [[bool((k <= q or block(0, 0, q, k)) and lower(0, 0, q, k)) for k in range(length)] for q in range(length)]
    return torch.tensor(rows)


@pytest.mark.parametrize("window", [None, 3])
def test_the_mask_is_transformers_block_overlay_under_the_window(window):
    flagged = [False, True, True, True, True, False, False, True, True, False]  # two images, 4 and 2 tokens
    meta = AttentionMetadata.build([10], [0], [[1, 2, 3]], BLOCK, "cpu")
    meta.attend_both_ways(torch.tensor(flagged))
    plan = meta.prefills[0]
    assert plan.spans == [(1, 5), (7, 9)]
    assert torch.equal(plan.mask(window), transformers_mask(10, flagged, window))
    plain = window_mask(plan.query_positions, plan.key_positions, window)
    assert torch.equal(plain, transformers_mask(10, [False] * 10, window))


def test_spans_are_per_sequence_and_in_positions():
    """Two prompts in one step, the second after a cached prefix of 6: its run of flagged tokens starts the chunk
    (the rest of an image whose first tokens are cached), so its span is [6, 9) in positions."""
    flagged = [False, True, True, False, True, True, True, False]
    meta = AttentionMetadata.build([4, 4], [0, 6], [[1, 2], [3, 4, 5]], BLOCK, "cpu")
    meta.attend_both_ways(torch.tensor(flagged))
    assert [plan.spans for plan in meta.prefills] == [[(1, 3)], [(6, 9)]]


def reference_attention(q, k, v, mask, scale):
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(q.shape[1] // k.shape[1], 1)) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    return torch.einsum("hqk,khd->qhd", probs, v.repeat_interleave(q.shape[1] // v.shape[1], 1))


@pytest.mark.parametrize("cached, window", [(0, None), (0, 3), (5, None), (5, 3)])
def test_a_prefill_with_spans_attends_both_ways_within_them(cached, window):
    """The chunk's last L tokens after `cached` ones in the cache: rows as dense attention over the whole context
    under the mask (the same for the chunk's rows whether its first image tokens are cached or not)."""
    torch.manual_seed(0)
    total, heads, kv_heads, dim, scale = 12, 4, 2, 8, 0.3
    flagged = [False, False, True, True, True, True, True, False, False, True, True, False]
    q, k, v = torch.randn(total, heads, dim), torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    k_cache, v_cache = torch.zeros(5 * BLOCK, kv_heads, dim), torch.zeros(5 * BLOCK, kv_heads, dim)
    table = [3, 1, 4]
    if cached:  # the prefix's K/V, written by an earlier step
        slots = torch.tensor([table[i // BLOCK] * BLOCK + i % BLOCK for i in range(cached)])
        k_cache[slots], v_cache[slots] = k[:cached], v[:cached]
    meta = AttentionMetadata.build([total - cached], [cached], [table], BLOCK, "cpu")
    meta.attend_both_ways(torch.tensor(flagged[cached:]))
    out = SdpaBackend().forward(q[cached:], k[cached:], v[cached:], k_cache, v_cache, meta, scale, window)
    expected = reference_attention(q, k, v, transformers_mask(total, flagged, window), scale)[cached:]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    causal = SdpaBackend().forward(q[cached:], k[cached:], v[cached:], k_cache, v_cache, _plain(meta), scale, window)
    assert (causal - out).abs().max() > 1e-2  # the spans changed the image rows


def _plain(meta: AttentionMetadata) -> AttentionMetadata:
    meta.prefills[0].spans = []
    meta.prefills[0].masks.clear()
    return meta
