"""The shard engine (batch state, runner, sampling, stopping) against transformers on the tiny Llama."""

from __future__ import annotations

import math

import torch

from kettle.proto import generate_pb2 as pb
from tests.models.engine_driver import make_batch, run_to_end

PROMPTS = ["The capital of France is", "Hello", "def add(a, b):\n    return a + b\n", "你好，世界！今天"]


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    _tokenizer, model = hf
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def test_batched_greedy_equals_transformers(engine, hf):
    tokenizer, _ = hf
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    tokens = run_to_end(engine, make_batch(1, prompts, first_id=1, max_new_tokens=12))
    for i, ids in enumerate(prompts):
        assert tokens[1 + i] == hf_greedy(hf, ids, 12), PROMPTS[i]


def test_request_joining_a_running_batch_keeps_outputs(engine, hf):
    tokenizer, _ = hf
    a, b = (tokenizer(p).input_ids for p in PROMPTS[:2])
    first = engine.prefill(pb.PrefillRequest(batch=make_batch(2, [a], first_id=10, max_new_tokens=8)))
    tokens = {10: list(first.generations[0].tokens.ids)}
    cached = engine.decode(pb.DecodeRequest(batches=[first.batch])).batch
    tokens[10] += []
    joined = engine.prefill(pb.PrefillRequest(batch=make_batch(3, [b], first_id=11, max_new_tokens=8)))
    tokens[11] = list(joined.generations[0].tokens.ids)
    batches = [cached, joined.batch]
    while batches:
        response = engine.decode(pb.DecodeRequest(batches=batches))
        for g in response.generations:
            tokens.setdefault(g.request_id, []).extend(g.tokens.ids)
        batches = [response.batch] if response.HasField("batch") else []
    assert len(tokens[11]) == 8
    assert tokens[11] == hf_greedy(hf, b, 8)


def test_prefill_logprobs_match_transformers(engine, hf):
    tokenizer, model = hf
    ids = tokenizer(PROMPTS[0]).input_ids
    batch = make_batch(4, [ids], first_id=20, max_new_tokens=1, prefill_logprobs=True)
    generation = engine.prefill(pb.PrefillRequest(batch=batch)).generations[0]
    prefill = generation.prefill_tokens
    assert list(prefill.ids) == ids
    assert math.isnan(prefill.logprobs[0])
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    expected = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor(list(prefill.logprobs[1:])), expected, atol=1e-4)
    assert generation.HasField("generated_text")
    assert generation.generated_text.finish_reason == pb.FINISH_REASON_LENGTH


def test_filter_batch_drops_requests(engine, hf):
    tokenizer, _ = hf
    prompts = [tokenizer(p).input_ids for p in PROMPTS[:3]]
    response = engine.prefill(pb.PrefillRequest(batch=make_batch(5, prompts, first_id=30, max_new_tokens=6)))
    kept = engine.filter_batch(pb.FilterBatchRequest(batch_id=5, request_ids=[31])).batch
    assert list(kept.request_ids) == [31]
    decoded = engine.decode(pb.DecodeRequest(batches=[kept]))
    assert [g.request_id for g in decoded.generations] == [31]
    assert response.batch.size == 3
    engine.clear_cache(pb.ClearCacheRequest(id=5))
    assert 5 not in engine.batches


def test_stop_sequence_and_eos(engine, hf):
    tokenizer, _ = hf
    ids = tokenizer(PROMPTS[0]).input_ids
    greedy = hf_greedy(hf, ids, 6)
    stop = tokenizer.decode(greedy[:3])
    batch = make_batch(6, [ids], first_id=40, max_new_tokens=6)
    batch.requests[0].stopping_parameters.stop_sequences.append(stop[-3:] if len(stop) >= 3 else stop)
    tokens = run_to_end(engine, batch)
    assert len(tokens[40]) <= 3


def test_a_new_request_reusing_an_id_gets_its_own_sampling(engine, hf):
    """Ids restart at 0 after warmup: a request that reuses the id of a finished one with other parameters
    (here hot random sampling, then plain greedy) must not be sampled with the old one's settings."""
    tokenizer, _ = hf
    ids = tokenizer(PROMPTS[0]).input_ids
    hot = make_batch(30, [ids], first_id=40, max_new_tokens=1)
    hot.requests[0].parameters.do_sample = True
    hot.requests[0].parameters.temperature = 100.0
    hot.requests[0].parameters.seed = 7
    run_to_end(engine, hot)
    assert run_to_end(engine, make_batch(31, [ids], first_id=40, max_new_tokens=4))[40] == hf_greedy(hf, ids, 4)
