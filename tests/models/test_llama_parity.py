"""Kettle's Llama-family implementation against transformers, on tiny random checkpoints of each variant.

Batched forwards over the paged cache must reproduce transformers' per-prompt results: logits of several
prompts in one forward, prefill continued from a cached prefix, and greedy generation with batched decodes.
"""

from __future__ import annotations

import pytest
import torch

from kettle.bench.drive import PROMPTS, greedy, new_cache, scattered_tables, step
from kettle.layers.attention import AttentionMetadata
from kettle.models.registry import load_model
from tests.fixtures import cpu_kernels, kernels_buildable

VARIANTS = ["llama", "tied", "llama3_rope", "dynamic_rope", "qwen2", "mistral_sliding"]
ATOL = 1e-4


@pytest.fixture(scope="module", params=VARIANTS)
def models(request, tmp_path_factory):
    """(Kettle models by kernels on/off, transformers model, prompt token ids) for one variant. Each op picks its
    backend when the model loads, so each setting of the kernels switch has its own load."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.fixtures import make_variant

    path = make_variant(tmp_path_factory.mktemp(request.param), request.param)
    tokenizer = AutoTokenizer.from_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    kettles = {}
    for on in (True, False):
        with cpu_kernels(on):
            kettles[on] = load_model(str(path), torch.float32, "cpu")
    return kettles, reference, [tokenizer(p).input_ids for p in PROMPTS]


def reference_logits(reference, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([ids])).logits[0]


# Each check runs with Kettle's CPU kernels and without them (KETTLE_TUNING=cpu-kernels=off: machines without gcc or
# AVX2).
KERNELS = pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "no-kernels"])


@KERNELS
def test_batched_prefill_matches_per_prompt_logits(models, kernels):
    kettles, reference, prompts = models
    kettle = kettles[kernels]
    tables, num_blocks = scattered_tables([len(p) for p in prompts])
    with cpu_kernels(kernels):
        logits, _ = step(kettle, new_cache(kettle, num_blocks), prompts, [0] * len(prompts), tables)
    expected = torch.cat([reference_logits(reference, p) for p in prompts])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


@KERNELS
def test_prefill_over_cached_prefix_matches(models, kernels):
    """Second call continues every prompt from the cache; splits give both chunked prefills and
    one-token continuations, interleaved (so decodes are not contiguous in the token layout)."""
    kettles, reference, prompts = models
    kettle = kettles[kernels]
    splits = [1, len(prompts[1]) - 1, 3, len(prompts[3]) - 1]
    tables, num_blocks = scattered_tables([len(p) for p in prompts])
    cache = new_cache(kettle, num_blocks)
    with cpu_kernels(kernels):
        step(kettle, cache, [p[:s] for p, s in zip(prompts, splits, strict=True)], [0] * 4, tables)
        logits, _ = step(kettle, cache, [p[s:] for p, s in zip(prompts, splits, strict=True)], splits, tables)
    expected = torch.cat([reference_logits(reference, p)[s:] for p, s in zip(prompts, splits, strict=True)])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


@KERNELS
def test_greedy_generation_matches_transformers(models, kernels):
    kettles, reference, prompts = models
    kettle = kettles[kernels]
    reference.generation_config.eos_token_id = None  # always 20 tokens, so whole sequences are compared
    with cpu_kernels(kernels):
        ours = greedy(kettle, prompts, max_new_tokens=20)
    for prompt, generated in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0)
        assert generated == out[0, len(prompt) :].tolist()


def test_metadata_layout():
    """Slots follow the block tables; decodes are grouped; last-token indices point at each sequence's end."""
    meta = AttentionMetadata.build([3, 1, 2], [0, 5, 4], [[7, 2], [4, 9], [1, 3]], 4, "cpu")
    assert meta.positions.tolist() == [0, 1, 2, 5, 4, 5]
    assert meta.slots.tolist() == [28, 29, 30, 37, 12, 13]
    assert meta.last_token_indices.tolist() == [2, 3, 5]
    assert meta.decode is not None and meta.decode.token_range == (3, 4)
    assert [(p.start, p.end, p.cache_len) for p in meta.prefills] == [(0, 3, 0), (4, 6, 4)]
    with pytest.raises(ValueError, match="cannot hold"):
        AttentionMetadata.build([9], [0], [[0, 1]], 4, "cpu")


def test_sharded_checkpoint_loads_like_single_file(models, tmp_path):
    kettles, reference, prompts = models
    on = kernels_buildable()  # the model loaded with the kernels as this run has them
    kettle = kettles[on]
    reference.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    tables, num_blocks = scattered_tables([len(prompts[1])])
    with cpu_kernels(on):
        sharded = load_model(str(tmp_path), torch.float32, "cpu")
        expected, _ = step(kettle, new_cache(kettle, num_blocks), prompts[1:2], [0], tables)
        logits, _ = step(sharded, new_cache(sharded, num_blocks), prompts[1:2], [0], tables)
    torch.testing.assert_close(logits, expected, atol=0, rtol=0)


def test_unknown_architecture_is_refused_by_name(tmp_path):
    # Types transformers knows run through the fallback (tests/models/test_fallback.py); only a type nobody
    # knows is refused, by name.
    (tmp_path / "config.json").write_text('{"model_type": "no-such-family"}')
    with pytest.raises(ValueError, match="'no-such-family'"):
        load_model(str(tmp_path), torch.float32, "cpu")
