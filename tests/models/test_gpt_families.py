"""Kettle's GPT-style families and Gemma 2 against transformers, on tiny random checkpoints of each.

Every case builds a 2-layer, hidden-64, 4-head model from the family's own transformers config class (with
the tiny tokenizer's vocabulary), saves it, and runs the shared parity check: batched paged logits within
1e-4 of transformers' in float32, and identical greedy tokens for three prompts in one batch. The families
with ALiBi or soft-capping also continue prompts from a cached prefix (chunked prefills mixed with
one-token continuations), the attention paths the greedy check does not reach.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kettle.bench.drive import new_cache, scattered_tables, step
from kettle.models.registry import ARCHITECTURES, load_model
from tests.models.family_parity import _prompts, _reference, assert_parity, save_tiny, tiny_settings


def common(settings: dict) -> dict:
    return dict(
        vocab_size=settings["vocab_size"],
        initializer_range=settings["initializer_range"],
        eos_token_id=settings["eos_token_id"],
        bos_token_id=settings["eos_token_id"],
    )


def gpt2_names(settings: dict) -> dict:
    """The tiny shape as GPT-2-style configs spell it (n_embd/n_layer/n_head: GPT-2, GPT-BigCode, GPT-J)."""
    return dict(
        n_embd=settings["hidden_size"],
        n_layer=settings["num_hidden_layers"],
        n_head=settings["num_attention_heads"],
        n_inner=settings["intermediate_size"],
        n_positions=settings["max_position_embeddings"],
    ) | common(settings)


def gpt2(path: Path, settings: dict, multi_query: bool | None = None) -> None:
    """GPT-2, or GPT-BigCode when `multi_query` is given."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPTBigCodeConfig, GPTBigCodeForCausalLM

    shape = gpt2_names(settings)
    if multi_query is None:
        save_tiny(path, GPT2Config(**shape), GPT2LMHeadModel)
    else:
        save_tiny(path, GPTBigCodeConfig(multi_query=multi_query, **shape), GPTBigCodeForCausalLM)


def opt(path: Path, settings: dict, **variant) -> None:
    from transformers import OPTConfig, OPTForCausalLM

    shape = dict(
        hidden_size=settings["hidden_size"],
        num_hidden_layers=settings["num_hidden_layers"],
        num_attention_heads=settings["num_attention_heads"],
        ffn_dim=settings["intermediate_size"],
        max_position_embeddings=settings["max_position_embeddings"],
        word_embed_proj_dim=settings["hidden_size"],
        init_std=settings["initializer_range"],
        pad_token_id=0,
    ) | common(settings)
    save_tiny(path, OPTConfig(**(shape | variant)), OPTForCausalLM)


def bloom(path: Path, settings: dict, num_heads: int = 4) -> None:
    from transformers import BloomConfig, BloomForCausalLM

    config = BloomConfig(hidden_size=16 * num_heads, n_layer=settings["num_hidden_layers"], n_head=num_heads)
    save_tiny(path, BloomConfig(**(config.to_dict() | common(settings))), BloomForCausalLM)


def mpt(path: Path, settings: dict, clip_qkv: float | None = None) -> None:
    from transformers import MptConfig, MptForCausalLM

    config = MptConfig(
        d_model=settings["hidden_size"],
        n_layers=settings["num_hidden_layers"],
        n_heads=settings["num_attention_heads"],
        max_seq_len=settings["max_position_embeddings"],
        attn_config={"clip_qkv": clip_qkv},
        **common(settings),
    )
    save_tiny(path, config, MptForCausalLM)


def falcon(path: Path, settings: dict, **layout) -> None:
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(
        hidden_size=settings["hidden_size"],
        num_hidden_layers=settings["num_hidden_layers"],
        num_attention_heads=settings["num_attention_heads"],
        max_position_embeddings=settings["max_position_embeddings"],
        **common(settings),
        **layout,
    )
    save_tiny(path, config, FalconForCausalLM)


def gemma2(path: Path, settings: dict) -> None:
    """Soft-caps small enough to bite on random weights, and a window of 8 that the longer prompts exceed."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        **(settings | common(settings)),
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=8,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=8.0,
        pad_token_id=0,
    )
    save_tiny(path, config, Gemma2ForCausalLM)


# Case name (as recorded in .family_parity.json) → builder and its variant.
CASES = {
    "gpt2": (gpt2, {}),
    "gpt_bigcode": (gpt2, {"multi_query": True}),
    "gpt_bigcode (multi-head)": (gpt2, {"multi_query": False}),
    "opt": (opt, {}),
    # 350m's layout: post-norm, embeddings projected in and out of a narrower word_embed_proj_dim.
    "opt (350m layout)": (opt, {"do_layer_norm_before": False, "word_embed_proj_dim": 32}),
    # Galactica-like: GELU, no biases; plus LayerNorms without affine weights.
    "opt (no bias, gelu)": (
        opt,
        {"enable_bias": False, "activation_function": "gelu", "layer_norm_elementwise_affine": False},
    ),
    "bloom": (bloom, {}),
    "bloom (6 heads)": (bloom, {"num_heads": 6}),  # ALiBi slopes for a head count not a power of two
    "mpt": (mpt, {}),
    "mpt (clip_qkv)": (mpt, {"clip_qkv": 0.5}),
    # 7B: multi-query (one K/V head), attention and MLP in parallel off one input LayerNorm.
    "falcon": (falcon, {"multi_query": True, "parallel_attn": True}),
    # 40B: grouped K/V heads (2 for 4 query heads), ln_attn + ln_mlp, qkv grouped per KV head.
    "falcon (40b layout)": (falcon, {"new_decoder_architecture": True, "num_kv_heads": 2}),
    # RW-1B style: ALiBi, a K/V head per query head (qkv interleaved per head), sequential blocks, biases.
    "falcon (alibi)": (falcon, {"alibi": True, "multi_query": False, "parallel_attn": False, "bias": True}),
    "gemma2": (gemma2, {}),
}
# The cases whose attention goes through ALiBi or soft-capping (and a sliding window, for Gemma 2).
SCORE_MODIFIED = ["bloom (6 heads)", "mpt", "falcon (alibi)", "gemma2"]


def build(path: Path, case: str) -> Path:
    builder, variant = CASES[case]
    builder(path, tiny_settings(path), **variant)
    return path


# KV heads the cache must be sized for (multi-query: one), where they differ from the query heads.
KV_HEADS = {"gpt_bigcode": 1, "falcon": 1, "falcon (40b layout)": 2, "gemma2": 2}


@pytest.mark.parametrize("case", list(CASES))
def test_family_matches_transformers(tmp_path, case):
    assert_parity(build(tmp_path, case), case)
    spec = load_model(str(tmp_path), torch.float32, "cpu").spec
    assert spec.num_kv_heads == KV_HEADS.get(case, spec.num_heads)


@pytest.mark.parametrize("case", SCORE_MODIFIED)
def test_prefill_over_cached_prefix_matches(tmp_path, case):
    """A second forward continues every prompt from the cache: a one-token continuation, a chunked prefill
    over a cached prefix, and another one-token continuation (so the decodes are not contiguous)."""
    path = build(tmp_path, case)
    kettle, reference, prompts = load_model(str(path), torch.float32, "cpu"), _reference(path), _prompts(path)
    splits = [len(prompts[0]) - 1, 3, len(prompts[2]) - 1]
    tables, num_blocks = scattered_tables([len(p) for p in prompts])
    cache = new_cache(kettle, num_blocks)
    step(kettle, cache, [p[:s] for p, s in zip(prompts, splits, strict=True)], [0] * 3, tables)
    logits, _ = step(kettle, cache, [p[s:] for p, s in zip(prompts, splits, strict=True)], splits, tables)
    with torch.no_grad():
        expected = torch.cat([reference(torch.tensor([p])).logits[0, s:] for p, s in zip(prompts, splits, strict=True)])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_falcon_aliases():
    """RefinedWeb names load as Falcon, with the layout their remote-code configs imply."""
    from kettle.models.falcon import FalconLayout

    assert ARCHITECTURES["RefinedWeb"] is not None and ARCHITECTURES["RefinedWebModel"] is not None
    # Remote-code RWConfig spellings: n_head / n_head_kv, the 40B layout implied by the model type.
    rw40b = SimpleNamespace(model_type="RefinedWeb", n_head=128, n_head_kv=8, parallel_attn=True)
    assert FalconLayout.from_config(rw40b).num_kv_heads == 8 and FalconLayout.from_config(rw40b).two_norms
    rw7b = SimpleNamespace(model_type="RefinedWebModel", n_head=71, multi_query=True, parallel_attn=True)
    assert FalconLayout.from_config(rw7b).num_kv_heads == 1 and not FalconLayout.from_config(rw7b).new_decoder


def test_mpt_options_it_lacks_are_refused(tmp_path):
    from transformers import MptConfig

    tiny_settings(tmp_path)
    MptConfig(d_model=64, n_heads=4, n_layers=1, attn_config={"qk_ln": True}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="qk_ln"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_checkpoint_without_base_prefix_loads_the_same(tmp_path):
    """OpenAI's GPT-2 (and BigScience's BLOOM) checkpoints name tensors "h.0..." rather than "transformer.h.0..."."""
    from safetensors.torch import load_file, save_file

    path = build(tmp_path / "prefixed", "gpt2")
    tensors = load_file(path / "model.safetensors")
    bare = tmp_path / "bare"
    bare.mkdir()
    save_file({name.removeprefix("transformer."): t for name, t in tensors.items()}, bare / "model.safetensors")
    (bare / "config.json").write_text((path / "config.json").read_text())
    prompts = _prompts(path)
    tables, num_blocks = scattered_tables([len(p) for p in prompts])
    logits = []
    for folder in (path, bare):
        model = load_model(str(folder), torch.float32, "cpu")
        logits.append(step(model, new_cache(model, num_blocks), prompts, [0] * 3, tables)[0])
    torch.testing.assert_close(logits[0], logits[1], atol=0, rtol=0)
