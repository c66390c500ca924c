"""Drives a real shard engine the way the router does: warmup, batches of requests, prefill and decode calls."""

from __future__ import annotations

import math
from pathlib import Path

from kettle.proto import generate_pb2 as pb
from kettle.shard.config import ShardConfig
from kettle.shard.server import build_engine

BLOCK = 16


def warm_engine(path: Path, **settings):
    """A shard engine over `path` (with more ShardConfig `settings`), warmed up like the router does; returns
    (engine, info)."""
    # float32 on any device (a GPU defaults to bf16), and a float32 KV cache (the CPU's default is float16): the
    # results are compared with transformers in fp32.
    settings.setdefault("kv_cache_dtype", "float32")
    engine, info = build_engine(ShardConfig(model_path=str(path), dtype="float32", **settings))
    warm = pb.WarmupRequest(max_input_tokens=200, max_prefill_tokens=256, max_total_tokens=256)
    warm.batch.requests.add(id=0, input_ids=[1, 2, 3]).stopping_parameters.max_new_tokens = 1
    engine.warmup(warm)
    return engine, info


def make_batch(batch_id: int, prompts: list[list[int]], first_id: int, max_new_tokens: int, **extra) -> pb.Batch:
    """A router-like batch: one request per prompt, EOS ignored, its own blocks."""
    batch = pb.Batch(id=batch_id)
    next_block = first_id * 64
    for i, ids in enumerate(prompts):
        n_blocks = math.ceil((len(ids) + max_new_tokens) / BLOCK)
        request = batch.requests.add(id=first_id + i, input_ids=ids, **extra)
        request.stopping_parameters.max_new_tokens = max_new_tokens
        request.stopping_parameters.ignore_eos_token = True
        request.blocks.extend(range(next_block, next_block + n_blocks))
        next_block += n_blocks
    return batch


def collect(response, tokens: dict[int, list[int]], texts: dict[int, str] | None = None) -> list[pb.CachedBatch]:
    """Adds a response's tokens (and final texts) to the dicts; returns its cached batch as a list."""
    for g in response.generations:
        tokens.setdefault(g.request_id, []).extend(g.tokens.ids)
        if texts is not None and g.HasField("generated_text"):
            texts[g.request_id] = g.generated_text.text
    return [response.batch] if response.HasField("batch") else []


def run_to_end(engine, batch: pb.Batch, texts: dict[int, str] | None = None) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    cached = collect(engine.prefill(pb.PrefillRequest(batch=batch)), tokens, texts)
    while cached:
        cached = collect(engine.decode(pb.DecodeRequest(batches=cached)), tokens, texts)
    return tokens


def join_mid_batch(engine, first: list[int], second: list[int], n: int, base_id: int) -> dict[int, list[int]]:
    """`first` decodes alone for two steps, then `second` joins the running batch in a step that mixes its
    prompt with `first`'s decode (a Prefill with the cached batch, as the router sends it); both run to the end."""
    tokens: dict[int, list[int]] = {}
    cached = collect(engine.prefill(pb.PrefillRequest(batch=make_batch(base_id, [first], base_id, n))), tokens)
    cached = collect(engine.decode(pb.DecodeRequest(batches=cached)), tokens)
    joining = make_batch(base_id + 1, [second], base_id + 1, n)
    cached = collect(engine.prefill(pb.PrefillRequest(batch=joining, cached_batch=cached[0])), tokens)
    while cached:
        cached = collect(engine.decode(pb.DecodeRequest(batches=cached)), tokens)
    return tokens


def mixed_batch(ids: list[list[int]], max_new_tokens: int, **extra) -> pb.Batch:
    """Batch 1 of four requests (ids 10-13) over prompts ids[0], ids[1], ids[2], ids[0]: greedy with the stop
    sequence "一起", seeded sampling, a regex grammar (EOS allowed), plain greedy."""
    from kettle.grammar import GRAMMAR_TYPE_REGEX

    batch = make_batch(1, [*ids[:3], ids[0]], first_id=10, max_new_tokens=max_new_tokens, **extra)
    batch.requests[0].stopping_parameters.stop_sequences.append("一起")
    sampled = batch.requests[1].parameters
    sampled.do_sample, sampled.temperature, sampled.top_k, sampled.seed = True, 0.9, 40, 11
    batch.requests[2].parameters.grammar = "[a-z]{3,8}"
    batch.requests[2].parameters.grammar_type = GRAMMAR_TYPE_REGEX
    batch.requests[2].stopping_parameters.ignore_eos_token = False
    return batch
