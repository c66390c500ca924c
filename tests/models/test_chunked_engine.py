"""Chunked prefill on the shard engine (tiny Llama) against transformers: a prompt computed in chunks beside a
running decode yields no token before its last chunk, then transformers' greedy tokens and prompt logprobs."""

from __future__ import annotations

import random

import pytest
import torch

from kettle.proto import generate_pb2 as pb

LONG = "The capital of France is Paris. The capital of Germany is Berlin. Hello world! How are you today?"


def request(batch: pb.Batch, request_id: int, ids: list[int], first_block: int, **extra) -> pb.Request:
    r = batch.requests.add(id=request_id, input_ids=ids, blocks=range(first_block, first_block + 8), **extra)
    r.stopping_parameters.max_new_tokens = 6
    r.stopping_parameters.ignore_eos_token = True
    return r


def test_chunks_beside_a_decode_give_transformers_tokens_and_prompt_logprobs(engine, hf):
    tokenizer, model = hf
    short, long = tokenizer("Hello").input_ids, tokenizer(LONG).input_ids
    assert len(long) > 12
    first = engine.prefill(pb.PrefillRequest(batch=_batch(1, [(1, short, 0, {})])))
    got: dict[int, list] = {1: list(first.generations), 2: []}
    new = _batch(2, [(2, long, 8, {"chunk_len": 5, "prefill_logprobs": True})])
    response = engine.prefill(pb.PrefillRequest(batch=new, cached_batch=first.batch))
    steps_before_first = 0
    while response.HasField("batch"):
        for g in response.generations:
            got[g.request_id].append(g)
        steps_before_first += not got[2]
        cached = response.batch
        cached.chunk_lens[2] = 5  # later chunks: as the router sends them
        response = engine.decode(pb.DecodeRequest(batches=[cached]))
    for g in response.generations:
        got[g.request_id].append(g)
    assert steps_before_first == -(-len(long) // 5) - 1, "a token came before the prompt's last chunk"
    assert [g.tokens.ids[0] for g in got[2]] == _greedy(model, long, 6)
    assert [g.tokens.ids[0] for g in got[1]] == _greedy(model, short, 6)
    prefills = [g.prefill_tokens for g in got[2] if g.prefill_tokens.ids]
    assert len(prefills) == 1 and list(prefills[0].ids) == long
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([long])).logits[0, :-1], -1)
    expected = expected.gather(1, torch.tensor(long[1:]).unsqueeze(1)).squeeze(1).tolist()
    assert list(prefills[0].logprobs[1:]) == pytest.approx(expected, abs=1e-4)


def _batch(batch_id: int, requests: list[tuple]) -> pb.Batch:
    batch = pb.Batch(id=batch_id)
    for request_id, ids, first_block, extra in requests:
        request(batch, request_id, ids, first_block, **extra)
    return batch


def _greedy(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("seed", [0, 1])
def test_random_mixes_of_chunks_prompts_and_decodes_match_transformers(engine, hf, seed):
    """Requests join a running batch at random steps with random chunk sizes (several prompts in flight at
    once, which the router never does but the shard must handle): each gets transformers' greedy tokens."""
    rng = random.Random(seed)
    tokenizer, model = hf
    texts = [LONG, "你好，世界！今天天气很好。", "def add(a, b):\n    return a + b\n", "Emoji: 😀 🎉 and more text"]
    prompts = {100 * (seed + 1) + i: tokenizer(rng.choice(texts)).input_ids[: rng.randint(1, 30)] for i in range(8)}
    waiting, tokens, cached, step = list(prompts), {i: [] for i in prompts}, None, 0
    while waiting or cached is not None:
        joining = [waiting.pop(0) for _ in range(min(len(waiting), rng.randint(0, 2)))]
        if cached is not None:
            for request_id in cached.request_ids:  # any request still in prefill takes its next random chunk
                cached.chunk_lens[request_id] = rng.randint(1, 8)
        if joining:
            specs = [(i, prompts[i], (i % 100) * 8, {"chunk_len": rng.choice([0, 1, 3, 7])}) for i in joining]
            response = engine.prefill(pb.PrefillRequest(batch=_batch(1000 + step, specs), cached_batch=cached))
        elif cached is not None:
            response = engine.decode(pb.DecodeRequest(batches=[cached]))
        else:
            continue
        for g in response.generations:
            tokens[g.request_id].extend(g.tokens.ids)
        cached, step = (response.batch if response.HasField("batch") else None), step + 1
    for request_id, ids in prompts.items():
        assert tokens[request_id] == _greedy(model, ids, 6), (seed, request_id)
