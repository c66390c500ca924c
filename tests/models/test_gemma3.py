"""Gemma 3's language model natively (`gemma3_text`, Gemma3ForCausalLM) against transformers (float32): logits of
prompts of different lengths in one batch, a window of 4 tokens that they and their greedy continuations exceed,
greedy tokens equal to `generate`'s, a prefill continued over the cache then decoded, each layer rotating with its
own RoPE table, and the fused CPU decode step running each layer on its own table (equal to the layer-by-layer
forward, and to transformers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kettle.bench import drive
from kettle.bench.drive import new_cache, scattered_tables, step
from kettle.models import decoder_step
from kettle.models.hf_config import layer_rope_parameters
from kettle.models.registry import load_model
from tests.fixtures import torch_threads, tune
from tests.models.family_parity import NEW_TOKENS, _prompts, _reference, assert_parity, save_tiny, tiny_settings
from tests.models.test_gpt_families import common

# The local and global bases far apart, and the global table linearly scaled as in the 4B-27B checkpoints: a layer
# rotated with the other layer's table gives other logits.
ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000.0},
}


def make_gemma3_text(path: Path, **extra) -> Path:
    """A tiny random Gemma 3 text model: a sliding layer (window 4) then a full one, head_dim 16, scores scaled by
    query_pre_attn_scalar 24, no soft-capping (Gemma 3's default)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    settings = tiny_settings(path)
    config = Gemma3TextConfig(
        **(settings | common(settings)), head_dim=16, query_pre_attn_scalar=24, sliding_window=4, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention"], rope_parameters=ROPE, **extra,
    )  # fmt: skip
    return save_tiny(path, config, Gemma3ForCausalLM)


@pytest.fixture(scope="module")
def gemma3_text(tmp_path_factory) -> Path:
    return make_gemma3_text(tmp_path_factory.mktemp("gemma3_text"))


def test_family_matches_transformers(gemma3_text):
    """Three prompts (3 to ~30 tokens) past the window of 4 in one batch, then 12 greedy tokens each, with Kettle's
    CPU kernels and without."""
    assert_parity(gemma3_text, "gemma3_text")


def test_a_prefill_continued_over_the_cache_then_decoded(gemma3_text):
    """A first chunk of each prompt, the rest over the cached K/V (past the window), then one decode step: every
    row's logits as transformers' forward over the whole sequence gives them."""
    model, reference = load_model(str(gemma3_text), torch.float32, "cpu"), _reference(gemma3_text)
    prompts = _prompts(gemma3_text)
    splits = [len(prompts[0]) - 1, 3, 9]
    tables, num_blocks = scattered_tables([len(p) + 1 for p in prompts])
    cache = new_cache(model, num_blocks)
    step(model, cache, [p[:s] for p, s in zip(prompts, splits, strict=True)], [0] * 3, tables)
    rest, _ = step(model, cache, [p[s:] for p, s in zip(prompts, splits, strict=True)], splits, tables)
    decode, _ = step(model, cache, [[7], [8], [9]], [len(p) for p in prompts], tables)
    expected_rest, expected_decode = [], []
    with torch.no_grad():
        for prompt, split, token in zip(prompts, splits, (7, 8, 9), strict=True):
            logits = reference(torch.tensor([[*prompt, token]])).logits[0]
            expected_rest.append(logits[split:-1])
            expected_decode.append(logits[-1])
    torch.testing.assert_close(rest, torch.cat(expected_rest), atol=1e-4, rtol=0)
    torch.testing.assert_close(decode, torch.stack(expected_decode), atol=1e-4, rtol=0)


def test_each_layer_rotates_with_its_own_table(gemma3_text):
    model = load_model(str(gemma3_text), torch.float32, "cpu")
    local, full = model.layer_rotary
    assert (local.theta, local.rope_type, full.theta, full.rope_type) == (10.0, "default", 1000.0, "linear")
    assert model.rotary is local and model.layers[0].attn.sliding_window == 4
    assert model.layers[1].attn.sliding_window is None and model.layers[1].attn.q_norm is not None


def test_the_fused_decode_step_runs_each_layer_on_its_own_table(gemma3_text, monkeypatch):
    """Every part of Gemma 3 is one the C step has (int4 projections, q/k norms, branch norms, a window of 4 that the
    contexts pass), its two RoPE tables too: each step's cos/sin of both, the sliding layer reading the local one,
    the full layer the global one. Its decode logits are the layer-by-layer forward's, bit for bit (two threads:
    the split of the work between them exercised); the full layer put on the local table gives others."""
    model = load_model(str(gemma3_text), torch.float32, "cpu", quantize="int4")
    fused_step = model.cpu_decoder_step
    assert fused_step is not None, decoder_step.DecoderStep.why_not
    assert fused_step.decoder.rope_tables == 2 and [layer.rope_table for layer in fused_step._layers] == [0, 1]
    prompts = _prompts(gemma3_text)
    with torch_threads(2):
        fused, layer_by_layer = drive.decode_logits(model, prompts, True), drive.decode_logits(model, prompts, False)
        assert torch.equal(fused, layer_by_layer)
        tables = decoder_step.DecoderStep._rope_tables
        monkeypatch.setattr(decoder_step.DecoderStep, "_rope_tables", lambda self, m: [0] * len(tables(self, m)))
        one_table = drive.decode_logits(model, prompts, True)
    assert (one_table - fused).abs().max() > 1e-2


def test_the_fused_decode_step_matches_transformers(gemma3_text, monkeypatch):
    """The checkpoint's float32 weights read as rows (`cpu-linear=dense`), so that the fused step runs on them:
    greedy tokens equal to `generate`'s, and every decode step's logits within 1e-4 of transformers' forward over
    the whole sequence. Every decode step ran fused."""
    tune(monkeypatch, "cpu-linear=dense")
    model = load_model(str(gemma3_text), torch.float32, "cpu")
    assert model.cpu_decoder_step is not None, decoder_step.DecoderStep.why_not
    calls = []
    run = decoder_step.DecoderStep.__call__
    monkeypatch.setattr(decoder_step.DecoderStep, "__call__", lambda *a, **k: calls.append(1) or run(*a, **k))
    prompts, reference = _prompts(gemma3_text), _reference(gemma3_text)
    logits = drive.decode_logits(model, prompts, True, steps=NEW_TOKENS)  # [steps, S, V]
    assert len(calls) == NEW_TOKENS
    reference.generation_config.eos_token_id = None
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS + 1, do_sample=False)
            expected = reference(out[:, :-1]).logits[0, len(prompt) :]
        assert logits[:, i].argmax(-1).tolist() == out[0, len(prompt) + 1 :].tolist()
        torch.testing.assert_close(logits[:, i], expected, atol=1e-4, rtol=0)


def test_older_configs_name_the_bases_apart():
    """transformers 4's names (rope_theta, rope_local_base_freq, rope_scaling for the global layers) give the same
    per-layer settings as transformers 5's rope_parameters."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        num_hidden_layers=6,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    layers = layer_rope_parameters(config)
    assert layers[:5] == [{"rope_type": "default", "rope_theta": 1e4}] * 5
    assert layers[5] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}


def test_an_embedding_model_config_is_refused(tmp_path):
    make_gemma3_text(tmp_path, use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        load_model(str(tmp_path), torch.float32, "cpu")
