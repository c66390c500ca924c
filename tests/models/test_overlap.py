"""Overlap scheduling on a real engine: with the next step computed ahead after every call (as the shard's
service does), every token, logprob, text and finish reason equals the plain path's, through joins, a
filtered (cancelled) request, sampling, a grammar, a stop sequence and EOS."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from kettle.proto import generate_pb2 as pb
from tests.models.engine_driver import make_batch, mixed_batch

PROMPTS = ["The capital of France is", "Hello", "def add(a, b):\n    return a + b\n", "你好，世界！今天"]


class Driver:
    """Calls the engine as the router does; with `overlap`, computes the next step ahead after each call."""

    def __init__(self, engine, overlap: bool) -> None:
        self.engine, self.overlap = engine, overlap
        self.answers: list[tuple] = []

    def call(self, method: str, request):
        answer = getattr(self.engine, method)(request)
        if answer is not None and hasattr(answer, "generations"):
            for g in answer.generations:
                ended = (
                    (g.generated_text.text, g.generated_text.finish_reason) if g.HasField("generated_text") else None
                )
                self.answers.append((g.request_id, list(g.tokens.ids), list(g.tokens.logprobs), ended))
        if self.overlap:
            self.engine.look_ahead()
        return answer


def script(driver: Driver, tokenizer) -> None:
    """Four requests (greedy with a stop sequence, seeded sampling, a regex grammar, plain greedy), two decodes,
    the last one cancelled, a sampled request joining, then decoding to the end."""
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    first = mixed_batch(ids, max_new_tokens=12)
    cached = driver.call("prefill", pb.PrefillRequest(batch=first)).batch
    for _ in range(2):
        cached = driver.call("decode", pb.DecodeRequest(batches=[cached])).batch
    keep = [i for i in cached.request_ids if i != 13]
    cached = driver.call("filter_batch", pb.FilterBatchRequest(batch_id=cached.id, request_ids=keep)).batch
    cached = driver.call("decode", pb.DecodeRequest(batches=[cached])).batch
    joining = make_batch(2, [ids[3]], first_id=20, max_new_tokens=10)
    joining.requests[0].parameters.do_sample, joining.requests[0].parameters.seed = True, 3
    answer = driver.call("prefill", pb.PrefillRequest(batch=joining, cached_batch=cached))
    while answer.HasField("batch"):
        answer = driver.call("decode", pb.DecodeRequest(batches=[answer.batch]))


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    return AutoTokenizer.from_pretrained(tiny_llama_path)


@pytest.mark.parametrize("speculate", [0, 3])
def test_steps_computed_ahead_give_the_same_outputs(engine, tokenizer, monkeypatch, speculate):
    monkeypatch.setattr(engine.runner, "speculate", speculate)  # with drafts, the step computed ahead verifies them
    plain_steps: list[int] = []
    monkeypatch.setattr(engine.runner, "step", _spy(engine.runner.step, plain_steps))
    plain = Driver(engine, overlap=False)
    script(plain, tokenizer)
    ahead_steps: list[int] = []
    monkeypatch.setattr(engine.runner, "step", _spy(engine.runner.step.__wrapped__, ahead_steps))
    engine.overlap = True
    try:
        ahead = Driver(engine, overlap=True)
        script(ahead, tokenizer)
    finally:
        engine.overlap = False
    assert ahead.answers == plain.answers
    assert {a[3][1] for a in plain.answers if a[3] is not None} >= {pb.FINISH_REASON_STOP_SEQUENCE}
    # Only the calls that changed the batch (prefills, the decode after the filter) ran their own step.
    assert len(ahead_steps) <= 4 < len(plain_steps) or speculate
    assert engine._ahead is None and not engine.batches


def test_a_dropped_step_puts_the_generators_back(engine, tokenizer):
    batch = make_batch(3, [tokenizer(PROMPTS[0]).input_ids], first_id=30, max_new_tokens=6)
    batch.requests[0].parameters.do_sample, batch.requests[0].parameters.seed = True, 5
    engine.overlap = True
    try:
        engine.prefill(pb.PrefillRequest(batch=batch))
        generator = engine.batches[3].requests[0].generator
        before = generator.get_state()
        engine.look_ahead()
        assert engine._ahead is not None and not generator.get_state().equal(before)
        engine.clear_cache(pb.ClearCacheRequest(id=3))
        assert engine._ahead is None and generator.get_state().equal(before)
    finally:
        engine.overlap = False


def _spy(fn, calls: list):
    def spied(requests, window=1):
        calls.append(len(requests))
        return fn(requests, window)

    spied.__wrapped__ = fn
    return spied


def test_the_kv_cache_faults_in_only_between_the_engines_steps(engine, tokenizer, monkeypatch):
    """Every step runs marked as the engine's work, so the KV cache's background faulting waits for it to end."""
    residency, marked = engine.runner.kv_cache.residency, []

    def step(requests, window=1):
        marked.append(residency._working)
        return step.__wrapped__(requests, window)

    step.__wrapped__ = engine.runner.step
    monkeypatch.setattr(engine.runner, "step", step)
    answer = engine.prefill(pb.PrefillRequest(batch=make_batch(4, [tokenizer(PROMPTS[1]).input_ids], 40, 3)))
    while answer.HasField("batch"):
        answer = engine.decode(pb.DecodeRequest(batches=[answer.batch]))
    assert len(marked) >= 3 and all(marked)
    assert residency._working == 0
