"""A tiny model served layer by layer over a float16 / bfloat16 KV cache (`--kv-cache-dtype`) against the same
model over a float32 cache: close logits, the same greedy tokens, and the shard's wiring of the flag."""

from __future__ import annotations

import pytest
import torch

from kettle.bench.drive import new_cache, scattered_tables, step
from kettle.models.registry import load_model
from tests.fixtures import make_variant
from tests.models.engine_driver import make_batch, run_to_end, warm_engine
from tests.unit.test_cpu_kernels import CAN_BUILD

PROMPTS = [[3, 17, 5, 9, 11], [8] * 23, [40, 41, 42], list(range(10, 47))]
# Largest logit difference over the largest logit, measured on these tiny random models over 12 decode steps
# (prefill included): fp16 ~1e-3, bf16 ~1e-2 (8 bits of mantissa against fp16's 11); the bounds leave ~3x.
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


def teacher_forced_logits(model, kv_dtype: torch.dtype | None, tokens: list[list[int]] | None, steps: int = 12):
    """Prefill then `steps` decodes of PROMPTS over a cache of `kv_dtype`, fed `tokens` (or its own greedy ones):
    every step's logits [steps + 1, S, V] and the tokens fed [steps, S]."""
    tables, num_blocks = scattered_tables([len(p) + steps for p in PROMPTS])
    cache = new_cache(model, num_blocks, kv_dtype)
    logits, meta = step(model, cache, PROMPTS, [0] * len(PROMPTS), tables)
    out, fed = [logits[meta.last_token_indices]], []
    for i in range(steps):
        nxt = out[-1].argmax(-1).tolist() if tokens is None else tokens[i]
        fed.append(nxt)
        logits, _ = step(model, cache, [[t] for t in nxt], [len(p) + i for p in PROMPTS], tables)
        out.append(logits)
    return torch.stack(out), fed


@pytest.mark.parametrize("kernels", [True, False] if CAN_BUILD else [False])
@pytest.mark.parametrize("variant", ["llama", "mistral_sliding"])  # grouped-query heads; a window of 8
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_cache_keeps_logits_close_and_greedy_tokens_equal(tmp_path, monkeypatch, kernels, variant, kv_dtype):
    if not kernels:
        monkeypatch.setattr("kettle.kernels.ops.available", lambda: False)  # SDPA, casting on read
    model = load_model(str(make_variant(tmp_path, variant)), torch.float32, torch.device("cpu"))
    expected, tokens = teacher_forced_logits(model, None, None)
    got, _ = teacher_forced_logits(model, kv_dtype, tokens)
    error = float((got - expected).abs().max() / expected.abs().max())
    assert 0 < error < TOLERANCE[kv_dtype]  # > 0: the cache really was 16-bit
    if kv_dtype == torch.float16:
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        # Free-running greedy decoding over the float16 cache picks the same tokens.
        assert teacher_forced_logits(model, kv_dtype, None)[1] == tokens
    else:
        # bfloat16 may flip a near-tie (it does once here, on mistral_sliding): only where float32's top two
        # logits are within the tolerance of each other.
        chosen = got.argmax(-1, keepdim=True)
        margin = expected.max(-1, keepdim=True).values - expected.gather(-1, chosen)
        assert float(margin.max() / expected.abs().max()) < TOLERANCE[kv_dtype]


@pytest.mark.skipif(not CAN_BUILD, reason="needs gcc and an AVX2/FMA/F16C CPU")
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_the_fused_step_reads_and_writes_a_16_bit_cache_as_the_layers_do(tmp_path, kv_dtype):
    """The one-call CPU decode step over a 16-bit cache: its K/V rows rounded as the cache write rounds them, read
    by the same attention kernel, so its logits equal the layer-by-layer forward's over the same cache."""
    model = load_model(str(make_variant(tmp_path, "llama")), torch.float32, torch.device("cpu"), quantize="int4")
    assert model.cpu_decoder_step is not None
    fused, tokens = teacher_forced_logits(model, kv_dtype, None, steps=6)
    model.__dict__["cpu_decoder_step"] = None  # the cached property, overridden: layer by layer
    layers, _ = teacher_forced_logits(model, kv_dtype, tokens, steps=6)
    assert torch.equal(fused, layers)


def test_the_shard_allocates_reports_and_sizes_the_cache_in_the_flag_s_dtype(tiny_llama_path):
    engine, info = warm_engine(tiny_llama_path, kv_cache_dtype="fp16")
    assert info.kv_cache_dtype == "float16" and info.dtype == "float32"
    assert engine.runner.kv_cache.dtype == torch.float16
    half = run_to_end(engine, make_batch(1, PROMPTS, 100, 8))
    engine, info = warm_engine(tiny_llama_path, kv_cache_dtype="float32")
    assert info.kv_cache_dtype == "float32" and engine.runner.kv_cache.dtype == torch.float32
    assert run_to_end(engine, make_batch(1, PROMPTS, 100, 8)) == half
    # With no flag, a float32 model on Kettle's CPU kernels keeps float16 K/V (as llama.cpp does).
    engine, info = warm_engine(tiny_llama_path, kv_cache_dtype=None)
    expected = "float16" if CAN_BUILD else "float32"
    assert info.kv_cache_dtype == expected and str(engine.runner.kv_cache.dtype) == f"torch.{expected}"
