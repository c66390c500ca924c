"""Speculative decoding (--speculate) on the tiny model: greedy output equals plain greedy, batched with requests
that do not draft; sampled output is reproducible; and the verifier's rejection sampling keeps the model's
distribution (a statistical check on a tiny vocabulary with fixed seeds). On the bundled model, asked to copy,
the default drafting policy drafts and equals plain greedy too."""

from __future__ import annotations

import pytest
import torch

from kettle.proto import generate_pb2 as pb
from kettle.shard.ngram import NgramDrafter
from kettle.shard.speculation import accepted_tokens, verify
from tests.models.engine_driver import make_batch, warm_engine

# Repetitive prompts, so that n-gram drafts exist; the model is random, so what it accepts is its own business.
# It never repeats two tokens of its context, so the tiny-model tests draft from 1-gram matches, every step in
# full, within a GPU step's rows (`draft_every_step`; on the CPU a batch of these 4 prompts fills a step's rows
# and would not draft): what they check is the verification, not the drafting policy.
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12], [40, 41, 42, 43, 40, 41, 42], [7, 7, 7, 7]]


@pytest.fixture
def draft_every_step(monkeypatch):
    monkeypatch.setenv("KETTLE_TUNING", "speculate-min-ngram=1,speculate-row-cost=0,speculate-step-rows=7")


def run(engine, speculate: int, configure=None, max_new_tokens: int = 40):
    """Runs PROMPTS to the end; returns {id: (tokens, logprobs, text, finish)} and the generations' draft counts."""
    engine.runner.speculate = speculate
    try:
        batch = make_batch(1, PROMPTS, first_id=1, max_new_tokens=max_new_tokens)
        if configure is not None:
            configure(batch)
        out: dict[int, list] = {}
        drafted = accepted = 0
        answer = engine.prefill(pb.PrefillRequest(batch=batch))
        while True:
            for g in answer.generations:
                tokens, logprobs, *_ = out.setdefault(g.request_id, [[], [], None, None])
                tokens += g.tokens.ids
                logprobs += g.tokens.logprobs
                drafted, accepted = drafted + g.draft_tokens, accepted + g.accepted_tokens
                if g.HasField("generated_text"):
                    out[g.request_id][2:] = [g.generated_text.text, g.generated_text.finish_reason]
            if not answer.HasField("batch"):
                return out, drafted, accepted
            answer = engine.decode(pb.DecodeRequest(batches=[answer.batch]))
    finally:
        engine.runner.speculate = 0


def test_greedy_with_drafts_equals_plain_greedy(engine, draft_every_step):
    def configure(batch):
        batch.requests[2].parameters.repetition_penalty = 1.3  # never drafts: decodes beside the others
        batch.requests[3].stopping_parameters.max_new_tokens = 7

    plain, drafted0, _ = run(engine, 0, configure)
    speculative, drafted, accepted = run(engine, 4, configure)
    assert drafted0 == 0 and drafted > 0 and accepted > 0
    for request_id, (tokens, logprobs, text, finish) in plain.items():
        got = speculative[request_id]
        assert got[0] == tokens and got[2:] == [text, finish]
        assert got[1] == pytest.approx(logprobs, abs=1e-4)
    assert len(speculative[4][0]) == 7


def test_seeded_sampling_with_drafts_is_reproducible(engine, draft_every_step):
    def configure(batch):
        for i, request in enumerate(batch.requests[1:]):  # the first stays greedy: processors take a subset
            request.parameters.do_sample, request.parameters.seed, request.parameters.temperature = True, i, 0.2

    first, _, accepted = run(engine, 3, configure)
    again, _, _ = run(engine, 3, configure)
    assert accepted > 0 and first == again


def test_stops_inside_accepted_drafts_end_the_request_there(engine, draft_every_step):
    """EOS and a stop sequence that fall among accepted drafts end the request at that very token."""
    plain, _, _ = run(engine, 0, max_new_tokens=24)
    text = plain[1][2]
    stop = text[len(text) // 2 : len(text) // 2 + 2]

    def configure(batch):
        for request in batch.requests:
            request.stopping_parameters.ignore_eos_token = False
        batch.requests[0].stopping_parameters.stop_sequences.append(stop)

    reference, _, _ = run(engine, 0, configure, max_new_tokens=24)
    speculative, _, accepted = run(engine, 4, configure, max_new_tokens=24)
    assert accepted > 0 and speculative.keys() == reference.keys()
    for request_id, (tokens, logprobs, text, finish) in reference.items():
        got = speculative[request_id]
        assert got[0] == tokens and got[2:] == [text, finish]
        # A verifying forward runs rows the plain step ran one at a time: on a GPU its matmuls round differently.
        assert got[1] == pytest.approx(logprobs, abs=1e-4)
    assert reference[1][3] == pb.FINISH_REASON_STOP_SEQUENCE


def test_bundled_int4_greedy_with_drafts_equals_plain_greedy():
    """The bundled model under int4 (its fused decode step), asked to copy a passage, beside a request with a
    repetition penalty (which never drafts): the same tokens with and without drafts."""
    from transformers import AutoTokenizer

    from kettle.hub.resolve import resolve_model

    path = resolve_model(None).path
    engine, _ = warm_engine(path, quantize="int4")
    tokenizer = AutoTokenizer.from_pretrained(path)
    passage = "The kettle boils water for tea. It sings when the water is hot, and then it clicks off. " * 2
    ask = [{"role": "user", "content": f"Repeat exactly:\n{passage}"}]
    text = tokenizer.apply_chat_template(ask, add_generation_prompt=True, tokenize=False)
    prompts = [tokenizer(text, add_special_tokens=False).input_ids, tokenizer("Tea is").input_ids]

    def run_bundled(speculate: int):
        engine.runner.speculate = speculate
        batch = make_batch(1, prompts, first_id=1, max_new_tokens=40)
        batch.requests[1].parameters.repetition_penalty = 1.2
        tokens: dict[int, list[int]] = {}
        accepted, answer = 0, engine.prefill(pb.PrefillRequest(batch=batch))
        while True:
            for g in answer.generations:
                tokens.setdefault(g.request_id, []).extend(g.tokens.ids)
                accepted += g.accepted_tokens
            if not answer.HasField("batch"):
                return tokens, accepted
            answer = engine.decode(pb.DecodeRequest(batches=[answer.batch]))

    plain, _ = run_bundled(0)
    speculative, accepted = run_bundled(4)
    assert speculative == plain and accepted >= 10  # drafts were taken: 10-13 of the 40 tokens, as the text goes


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter(1)
    assert drafter.propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert drafter.propose([1, 2, 3, 4, 1, 2, 9], 3) == []
    assert drafter.propose([1, 2, 3, 4, 1, 2, 9, 2], 2) == [9, 2]  # the latest "2" was followed by 9
    assert NgramDrafter(1).propose([5], 4) == [] and NgramDrafter(1).propose([5, 5], 0) == []


def test_rejection_sampling_keeps_the_target_distribution():
    """Fixed logits over 5 tokens, a draft of two tokens: the first emitted token follows p0, and the token
    after an accepted first draft follows p1, as if each had been sampled alone."""
    torch.manual_seed(0)
    scores = torch.randn(3, 5) * 1.5
    probs = torch.softmax(scores, dim=-1)
    draft = torch.stack([probs[0].argmax(), probs[1].argsort()[2]])  # a likely first draft, a middling second
    generator = torch.Generator().manual_seed(1234)
    n, first, second = 20000, torch.zeros(5), torch.zeros(5)
    for _ in range(n):
        tokens, _ = accepted_tokens(draft.tolist(), verify(scores, draft, generator).tolist())
        first[tokens[0]] += 1
        if tokens[0] == draft[0]:
            second[tokens[1]] += 1
    assert torch.allclose(first / n, probs[0], atol=0.012)
    assert torch.allclose(second / second.sum(), probs[1], atol=0.02)


def test_greedy_verification_takes_the_argmax_path():
    scores = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    assert accepted_tokens([1, 0], verify(scores, torch.tensor([1, 0]), None).tolist())[0] == [1, 0, 2]
    assert accepted_tokens([1, 2], verify(scores, torch.tensor([1, 2]), None).tolist())[0] == [1, 0]
    assert accepted_tokens([2, 0], verify(scores, torch.tensor([2, 0]), None).tolist())[0] == [1]
