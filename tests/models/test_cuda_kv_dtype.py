"""The tiny model over a float8 KV cache on CUDA (`--kv-cache-dtype fp8_e4m3fn | fp8_e5m2`): eager steps, decode
graphs, a chunk over a cached prefix, all teacher-forced against a bf16 cache. The Triton kernel over narrower
caches, and its own write of the new K/V, are checked against SDPA in tests/models/test_cuda_path.py.

Skipped without a CUDA GPU of compute capability 8.9 or newer (Triton converts float8 in hardware there).
"""

from __future__ import annotations

import random

import pytest
import torch

from kettle.bench.drive import BLOCK_SIZE, decode_hidden, scattered_tables
from kettle.layers.attention import AttentionMetadata
from kettle.models.registry import load_model
from kettle.tensors.kv_cache import KVCache

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU of compute capability 8.9+",
)


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm())


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
        logits.append(model.compute_logits(decode_hidden(model, decode_graphs, ids, meta, cache)))
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
