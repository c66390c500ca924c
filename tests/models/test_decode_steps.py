"""Several decode steps in one Decode call on a real engine: each request's tokens, logprobs, top tokens, final
text and finish reason equal those of the same steps called one at a time, through requests finishing inside a
call (length, a stop sequence, a grammar's end), seeded sampling, a filtered request and a join, with and
without speculative drafts."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from kettle.proto import generate_pb2 as pb
from tests.models.engine_driver import make_batch, mixed_batch

PROMPTS = ["The capital of France is", "Hello", "def add(a, b):\n    return a + b\n", "你好，世界！今天"]


class Recorder:
    """Calls the engine and gathers each request's whole output across calls."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.outputs: dict[int, dict] = {}
        self.decode_steps: list[int] = []

    def call(self, method: str, request):
        answer = getattr(self.engine, method)(request)
        for g in getattr(answer, "generations", ()):
            out = self.outputs.setdefault(g.request_id, {"ids": [], "logprobs": [], "texts": [], "top": []})
            out["ids"] += g.tokens.ids
            out["logprobs"] += g.tokens.logprobs
            out["texts"] += g.tokens.texts
            out["top"] += [list(t.ids) for t in g.top_tokens]
            if g.HasField("generated_text"):
                out["end"] = (g.generated_text.text, g.generated_text.finish_reason, g.generated_text.generated_tokens)
        if method == "decode":
            self.decode_steps.append(answer.steps)
        return answer

    def decode(self, cached: pb.CachedBatch, steps: int) -> pb.DecodeResponse:
        """`steps` decode steps: one call with max_steps, or (steps=-k) k calls of one step each."""
        if steps > 0:
            return self.call("decode", pb.DecodeRequest(batches=[cached], max_steps=steps))
        for _ in range(-steps):
            answer = self.call("decode", pb.DecodeRequest(batches=[cached]))
            if not answer.HasField("batch"):
                break
            cached = answer.batch
        return answer


def script(recorder: Recorder, tokenizer, schedule: list[int]) -> None:
    """Four requests (greedy with a stop sequence and top tokens, seeded sampling, a regex grammar, a short
    one), a decode call of the first scheduled size, the sampled request filtered out, another sampled request
    joining, then decode calls of the scheduled sizes to the end."""
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    first = mixed_batch(ids, max_new_tokens=14, top_n_tokens=2)
    first.requests[3].stopping_parameters.max_new_tokens = 3  # ends inside the first multi-step call
    cached = recorder.call("prefill", pb.PrefillRequest(batch=first)).batch
    schedule = iter(schedule)
    cached = recorder.decode(cached, next(schedule)).batch
    assert 11 in cached.request_ids, "the sampled request must still run to be filtered out"
    keep = [i for i in cached.request_ids if i != 11]
    filtered = recorder.call("filter_batch", pb.FilterBatchRequest(batch_id=cached.id, request_ids=keep))
    joining = make_batch(2, [ids[3]], first_id=20, max_new_tokens=10)
    joining.requests[0].parameters.do_sample, joining.requests[0].parameters.seed = True, 3
    request = pb.PrefillRequest(batch=joining)
    if filtered.HasField("batch"):
        request.cached_batch.CopyFrom(filtered.batch)
    answer = recorder.call("prefill", request)
    while answer.HasField("batch"):
        answer = recorder.decode(answer.batch, next(schedule, 4))


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    return AutoTokenizer.from_pretrained(tiny_llama_path)


@pytest.mark.parametrize("speculate", [0, 3])
def test_several_steps_per_call_give_the_outputs_of_one_step_per_call(engine, tokenizer, monkeypatch, speculate):
    monkeypatch.setattr(engine.runner, "speculate", speculate)
    batched = Recorder(engine)
    script(batched, tokenizer, [2, 3])
    # The same steps, one call each: the multi-step calls' step counts, replayed.
    single = Recorder(engine)
    script(single, tokenizer, [-n for n in batched.decode_steps])
    assert batched.outputs == single.outputs
    assert max(batched.decode_steps) > 1 and set(single.decode_steps) == {1}
    ends = {out["end"][1] for out in batched.outputs.values() if "end" in out}
    assert {pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP_SEQUENCE} <= ends or speculate
    assert not engine.batches


def test_a_call_stops_at_a_prompt_chunk_still_to_come(engine, tokenizer):
    """A request whose prompt is half prefilled needs the router's next chunk: the call runs one step only."""
    ids = tokenizer(PROMPTS[2] * 3).input_ids
    batch = make_batch(4, [ids], first_id=40, max_new_tokens=4)
    batch.requests[0].chunk_len = 8
    cached = engine.prefill(pb.PrefillRequest(batch=batch)).batch
    answer = engine.decode(pb.DecodeRequest(batches=[cached], max_steps=4))
    assert answer.steps == 1 and not answer.generations
    engine.clear_cache(pb.ClearCacheRequest(id=answer.batch.id))
    assert not engine.batches
