"""Test helpers: tiny checkpoints of each Llama-family variant, and a minimal driver of Kettle's paged forward.

The driver plays the router's and the shard's parts in the simplest way: it hands every sequence a scattered
block table, builds `AttentionMetadata` per step, and feeds greedy tokens back in, so tests exercise exactly
the interfaces the shard uses.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from kettle.layers.attention import AttentionMetadata
from kettle.models.registry import CausalLM
from kettle.tensors.kv_cache import KVCache
from tests.fixtures import make_tiny_llama, make_tokenizer, tiny_config

BLOCK_SIZE = 4  # small, so that even short prompts span several blocks

PROMPTS = [
    "Hi",
    "The capital of France is Paris. The capital of",
    "def add(a, b):\n    return",
    "你好，世界！今天天气很好。 😀 🎉 Large language models generate text",
]


def make_variant(path: Path, variant: str) -> Path:
    """A tiny checkpoint of `variant`: llama, tied, llama3_rope, dynamic_rope, qwen2 or mistral_sliding."""
    overrides = {
        "llama": {},
        "tied": {"tie_word_embeddings": True},
        "llama3_rope": {"rope_parameters": _rope("llama3", low_freq_factor=1.0, high_freq_factor=4.0)},
        # A short trained length, so prompts plus generations run past it and the base grows.
        "dynamic_rope": {"max_position_embeddings": 24, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
    }
    if variant in overrides:
        return make_tiny_llama(path, **overrides[variant])
    return _make_other(path, variant)


def _rope(rope_type: str, **extra) -> dict:
    return {
        "rope_type": rope_type,
        "rope_theta": 10000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 64,
    } | extra


def _make_other(path: Path, variant: str) -> Path:
    """Qwen2 (q/k/v biases, tied) and Mistral (sliding window of 8) through their own transformers classes."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer = make_tokenizer(path)
    common = tiny_config(tokenizer)
    if variant == "qwen2":
        config, cls = Qwen2Config(tie_word_embeddings=True, **common), Qwen2ForCausalLM
    elif variant == "mistral_sliding":
        config, cls = MistralConfig(sliding_window=8, tie_word_embeddings=False, **common), MistralForCausalLM
    else:
        raise ValueError(f"unknown test variant {variant!r}")
    torch.manual_seed(0)
    model = cls(config).eval()
    # Biases are zero-initialised; random ones make sure they are actually loaded and applied.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


def scattered_tables(lengths: list[int], seed: int = 0) -> tuple[list[list[int]], int]:
    """Block tables with enough blocks for each length, drawn shuffled from one pool (never contiguous)."""
    needs = [-(-n // BLOCK_SIZE) for n in lengths]
    pool = list(range(1, sum(needs) + 1))  # block 0 stays unused: it is the padding block
    random.Random(seed).shuffle(pool)
    tables, at = [], 0
    for need in needs:
        tables.append(pool[at : at + need])
        at += need
    return tables, sum(needs) + 1


def new_cache(model: CausalLM, num_blocks: int, kv_dtype: torch.dtype | None = None) -> KVCache:
    """A CPU cache for `model` in `kv_dtype` (default: the model's dtype)."""
    spec = model.spec
    dtype = kv_dtype or spec.dtype
    return KVCache(spec.num_layers, num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, dtype, "cpu")


def step(
    model: CausalLM, cache: KVCache, chunks: list[list[int]], cache_lens: list[int], tables: list[list[int]]
) -> tuple[torch.Tensor, AttentionMetadata]:
    """One forward over the concatenated chunks; returns logits of every new token [T, vocab] and the metadata."""
    meta = AttentionMetadata.build([len(c) for c in chunks], cache_lens, tables, BLOCK_SIZE, "cpu")
    input_ids = torch.tensor([t for chunk in chunks for t in chunk])
    hidden = model.forward(input_ids, meta.positions, cache, meta)
    return model.compute_logits(hidden), meta


def greedy(model: CausalLM, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Prefills all prompts in one forward, then decodes them together, argmax each step."""
    tables, num_blocks = scattered_tables([len(p) + max_new_tokens for p in prompts])
    cache = new_cache(model, num_blocks)
    logits, meta = step(model, cache, prompts, [0] * len(prompts), tables)
    tokens = logits[meta.last_token_indices].argmax(-1)
    generated = [tokens]
    for i in range(max_new_tokens - 1):
        cache_lens = [len(p) + i for p in prompts]
        logits, meta = step(model, cache, [[t] for t in tokens.tolist()], cache_lens, tables)
        tokens = logits.argmax(-1)
        generated.append(tokens)
    return torch.stack(generated, dim=1).tolist()


def decode_logits(
    model: CausalLM, prompts: list[list[int]], fused: bool, steps: int = 12, adapters: list[int] | None = None
) -> torch.Tensor:
    """Prefills `prompts`, then decodes them together greedily through the fused CPU decode step or layer by
    layer (`fused`); the logits of every decode step [steps, S, V]. `adapters`: each prompt's LoRA adapter (-1:
    the base model) when the model has adapters attached."""
    model.__dict__.pop("cpu_decoder_step", None)
    if not fused:
        model.__dict__["cpu_decoder_step"] = None  # the cached property, overridden: layer by layer
    tables, num_blocks = scattered_tables([len(p) + steps for p in prompts])
    cache = new_cache(model, num_blocks)
    if adapters is not None:
        model.lora_rows.set([a for p, a in zip(prompts, adapters, strict=True) for _ in p], torch.device("cpu"))
    logits, meta = step(model, cache, prompts, [0] * len(prompts), tables)
    tokens, out = logits[meta.last_token_indices].argmax(-1), []
    if adapters is not None:
        model.lora_rows.set(adapters, torch.device("cpu"))
    for i in range(steps):
        logits, _ = step(model, cache, [[t] for t in tokens.tolist()], [len(p) + i for p in prompts], tables)
        out.append(logits)
        tokens = logits.argmax(-1)
    model.__dict__.pop("cpu_decoder_step", None)
    return torch.stack(out)


def decode_hidden(model, graphs, tokens: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
    """One decode step's hidden states: eagerly without `graphs`, else by replay (which must happen)."""
    if graphs is None:
        return model.forward(tokens, meta.positions, cache, meta)
    replayed = graphs.run(tokens, meta)
    assert replayed is not None, "a decode step within the buckets must replay"
    return replayed.hidden
