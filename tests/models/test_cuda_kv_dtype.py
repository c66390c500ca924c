"""A KV cache in another dtype than the model's on CUDA (`--kv-cache-dtype`, TGI's fp8_e4m3fn / fp8_e5m2, or a
16-bit one): the Triton decode kernel reading it, the kernel's own write of the new token's K/V (saturating for
float8) against the SDPA path's, and the tiny model decoding over it, eagerly and through decode graphs.

Skipped without a CUDA GPU of compute capability 8.9 or newer (Triton converts float8 in hardware there).
"""

from __future__ import annotations

import random

import pytest
import torch

from kettle.layers.attention import AttentionMetadata
from kettle.layers.sdpa_attention import SdpaBackend
from kettle.models.registry import load_model
from kettle.tensors.kv_cache import KVCache
from tests.models.drive import BLOCK_SIZE, scattered_tables

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU of compute capability 8.9+",
)

KV_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float16]
MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2, torch.float16: 10}


def within_one_step(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """Every element of `got` within one unit in the last place of `dtype` of `want` (same rounding, or a tie
    broken the other way by a different conversion path)."""
    g, w = got.float(), want.float()
    step = w.abs() * 2.0 ** -MANTISSA_BITS[dtype] + torch.finfo(dtype).smallest_normal * 2.0 ** -MANTISSA_BITS[dtype]
    return bool(((g - w).abs() <= step).all())


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm())


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("seqs", "heads", "kv_heads", "head_dim", "window"), [(1, 8, 8, 128, None), (5, 8, 2, 80, 7)])
def test_paged_decode_widens_a_narrow_cache(kv_dtype, dtype, seqs, heads, kv_heads, head_dim, window):
    """The kernel's float32 math over the stored values equals SDPA over the same values held in float32."""
    from kettle.layers.cuda_attention import paged_decode

    rng = random.Random(seqs)
    cache_lens = [rng.randint(0, 300) for _ in range(seqs)]
    tables, num_blocks = scattered_tables([c + 1 for c in cache_lens])
    k_cache = torch.randn(num_blocks * BLOCK_SIZE, kv_heads, head_dim, device="cuda").to(kv_dtype)
    v_cache = torch.randn(num_blocks * BLOCK_SIZE, kv_heads, head_dim, device="cuda").to(kv_dtype)
    meta = AttentionMetadata.build([1] * seqs, cache_lens, tables, BLOCK_SIZE, "cuda")
    q = torch.randn(seqs, heads, head_dim, dtype=dtype, device="cuda")
    scale = head_dim**-0.5
    expected = SdpaBackend.decode(q.float(), k_cache.float(), v_cache.float(), meta.decode, BLOCK_SIZE, scale, window)
    table = meta.decode.block_ids.view(seqs, -1)
    out = paged_decode(q, k_cache, v_cache, table, meta.decode.query_positions.view(-1), BLOCK_SIZE, scale, window)
    assert relative(out, expected) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(("seqs", "kv_heads", "window"), [(1, 8, None), (6, 2, 9), (40, 4, None)])
def test_the_kernels_cache_write_equals_the_sdpa_paths(kv_dtype, seqs, kv_heads, window):
    """Decode-only steps write the new K/V inside the kernel, rounded (and saturated) as `write_slots` does, and
    attend to the rounded values, as the SDPA path does when it reads them back."""
    from kettle.layers.cuda_attention import CudaBackend

    rng = random.Random(seqs)
    cache_lens = [rng.randint(0, 200) for _ in range(seqs)]
    tables, num_blocks = scattered_tables([c + 1 for c in cache_lens])
    meta = AttentionMetadata.build([1] * seqs, cache_lens, tables, BLOCK_SIZE, "cuda")
    caches = [torch.randn(num_blocks * BLOCK_SIZE, kv_heads, 64, device="cuda").to(kv_dtype) for _ in range(2)]
    q, k_new, v_new = (torch.randn(seqs, n, 64, device="cuda") for n in (8, kv_heads, kv_heads))
    k_new[:, :, 0], v_new[:, :, 1] = 1000.0, -1000.0  # beyond e4m3fn's 448: saturates instead of NaN
    reference_caches = [c.clone() for c in caches]
    expected = SdpaBackend().forward(q, k_new, v_new, *reference_caches, meta, 0.125, window)
    out = CudaBackend().forward(q, k_new, v_new, *caches, meta, 0.125, window)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    for got, want in zip(caches, reference_caches, strict=True):
        assert within_one_step(got, want, kv_dtype)


def forced_logits(model, kv_dtype: torch.dtype, graphs: bool, chunks=((0, 8), (8, 16))) -> list[torch.Tensor]:
    """Logits of 4 sequences of 24 fixed tokens: a prefill of 8, a chunk of 8 over the cached 8 (read back from
    the cache), then 8 decode steps, all teacher-forced, so no greedy choice depends on the cache's rounding."""
    from kettle.shard.cuda_graphs import DecodeGraphs

    spec, prompts = model.spec, [[random.Random(i).randrange(3, 200) for _ in range(24)] for i in range(4)]
    tables, num_blocks = scattered_tables([24] * 4)
    cache = KVCache(spec.num_layers, num_blocks + 1, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, kv_dtype, "cuda")
    decode_graphs = DecodeGraphs(model, cache, num_blocks, (4,)) if graphs else None
    logits = []
    for start, end in chunks:
        meta = AttentionMetadata.build([end - start] * 4, [start] * 4, tables, BLOCK_SIZE, "cuda")
        ids = torch.tensor([t for p in prompts for t in p[start:end]], device="cuda")
        logits.append(model.compute_logits(model.forward(ids, meta.positions, cache, meta)))
    for position in range(16, 24):
        meta = AttentionMetadata.build([1] * 4, [position] * 4, tables, BLOCK_SIZE, "cuda")
        ids = torch.tensor([p[position] for p in prompts], device="cuda")
        if decode_graphs is None:
            hidden = model.forward(ids, meta.positions, cache, meta)
        else:
            replayed = decode_graphs.run(ids, meta)
            assert replayed is not None, "a decode step of the bucket's size must replay"
            hidden = replayed.hidden
        logits.append(model.compute_logits(hidden))
    return logits


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_tiny_model_over_a_float8_cache(tiny_llama_path, kv_dtype):
    """Graph replay over a float8 cache gives the eager logits, and both stay near a bf16 cache's (this tiny
    model's large random weights amplify rounding: bf16 itself is off float32 by several percent)."""
    model = load_model(str(tiny_llama_path), torch.bfloat16, "cuda")
    reference = forced_logits(model, torch.bfloat16, graphs=False)
    eager = forced_logits(model, kv_dtype, graphs=False)
    replayed = forced_logits(model, kv_dtype, graphs=True)
    for got, want in zip(replayed, eager, strict=True):
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)
    errors = [relative(got, want) for got, want in zip(eager, reference, strict=True)]
    print(f"{kv_dtype}: relative logit error against a bf16 cache, per call: {[round(e, 4) for e in errors]}")
    assert max(errors) < 0.3
    # The first 16 tokens prefilled in one call attend as the chunk over 8 cached ones does (the new K/V are
    # rounded as the cache holds them): a prefix-cache hit does not change a served answer.
    whole = forced_logits(model, kv_dtype, graphs=False, chunks=((0, 16),))[0].view(4, 16, -1)[:, 8:]
    torch.testing.assert_close(eager[1].view(4, 8, -1), whole, atol=0.05, rtol=0.02)
