"""Batch invariance on the shard engine (`KETTLE_TUNING`'s `batch-invariant`, on by default), the tiny Llama under int4
in both weight layouts: prompts sent together, their prompts cut into chunks of 5 (so that some last chunk is a single
token, and steps mix prompt chunks with other requests' decodes), with drafts verified every step under `--speculate`,
give each request the tokens and logprobs, to the last bit, that it gets alone with its prompt in one chunk, greedy and
seeded. Without the switch the rows layout's fast paths give other bits."""

from __future__ import annotations

import pytest

from kettle import settings
from kettle.kernels import ops
from kettle.kernels.structs import LINEAR_Q4L
from kettle.proto import generate_pb2 as pb
from tests.models.engine_driver import make_batch, warm_engine

PROMPTS = [
    [5, 9, 33, 2, 70, 41, 12, 8, 99, 3, 17],  # 11 tokens: chunks of 5, 5 and 1
    [3, 4, 88, 12, 60, 61],
    [60, 61, 62, 7, 7, 30, 11, 95, 20, 21, 22, 23, 24, 25, 26, 27],
    [101, 102],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60],
]
TOKENS = 12
# Every step drafts what the tiny random model's contexts allow (it rarely repeats itself), 7 rows at most.
DRAFT_EVERY_STEP = "speculate-min-ngram=1,speculate-row-cost=0,speculate-step-rows=7"


@pytest.fixture(scope="module", params=["rows", "lanes"])
def engine(request, tiny_llama_path):
    """The tiny Llama under int4 in the rows layout or in lanes (the default wherever the kernels run)."""
    settings.reload()
    if request.param == "lanes" and not ops.lanes(LINEAR_Q4L):
        pytest.skip("the lanes layout needs the kernels (AVX-512 VNNI or AVX2)")
    # (a module's fixture runs before tests/conftest.py's per-test settings: it reads them afresh itself)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KETTLE_TUNING", "" if request.param == "lanes" else "lanes=off")
        settings.reload()
        engine = warm_engine(tiny_llama_path, quantize="int4")[0]
    settings.reload()
    layers = [m for m in engine.runner.model.modules() if hasattr(m, "lanes")]
    assert layers and all(m.lanes == (request.param == "lanes") for m in layers)
    return engine


def batch(batch_id: int, prompts: list[int], sampled: bool, chunk: int = 0) -> pb.Batch:
    """Requests `prompts` (indices into PROMPTS, request id 100 + index), seeded sampling or greedy."""
    out = make_batch(batch_id, [PROMPTS[i] for i in prompts], first_id=1, max_new_tokens=TOKENS)
    for request, i in zip(out.requests, prompts, strict=True):
        request.id, request.chunk_len = 100 + i, chunk
        if sampled:
            request.parameters.do_sample, request.parameters.temperature, request.parameters.seed = True, 0.9, i
    return out


def run(engine, request: pb.Batch, chunk: int, steps: int = 1) -> dict[int, list[tuple[int, float]]]:
    """Each request's (token, logprob) pairs, the batch run to its end (later prompt chunks of `chunk` tokens;
    decode calls of up to `steps` steps: a greedy batch's run in one C call, `greedy_steps`)."""
    out: dict[int, list[tuple[int, float]]] = {}
    response = engine.prefill(pb.PrefillRequest(batch=request))
    while True:
        for g in response.generations:
            out.setdefault(g.request_id, []).extend(zip(g.tokens.ids, g.tokens.logprobs, strict=True))
        if not response.HasField("batch"):
            return out
        cached = response.batch
        for r in request.requests:
            cached.chunk_lens[r.id] = chunk
        response = engine.decode(pb.DecodeRequest(batches=[cached], max_steps=steps))


def alone_and_together(engine, sampled: bool) -> tuple[dict, dict]:
    alone = {}
    for i in range(len(PROMPTS)):
        alone |= run(engine, batch(1, [i], sampled), 0)
    together = run(engine, batch(2, list(range(len(PROMPTS))), sampled, chunk=5), 5, steps=3)
    return alone, together


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_requests_get_the_same_tokens_alone_and_together_with_drafts_or_without(engine, monkeypatch, sampled):
    """Speculation changes only how many rows a step verifies: a request's tokens (greedy, and seeded: one uniform
    of its generator per token emitted) are those of plain decoding."""
    monkeypatch.setenv("KETTLE_TUNING", DRAFT_EVERY_STEP)
    runs = {}
    for speculate in (0, 4):
        monkeypatch.setattr(engine.runner, "speculate", speculate)
        runs[f"alone, --speculate {speculate}"], runs[f"together, --speculate {speculate}"] = alone_and_together(
            engine, sampled
        )
    plain = runs["alone, --speculate 0"]
    assert sorted(plain) == [100 + i for i in range(len(PROMPTS))] and all(len(t) == TOKENS for t in plain.values())
    assert {name: run == plain for name, run in runs.items()} == dict.fromkeys(runs, True)


def test_without_the_switch_the_rows_layouts_fast_paths_differ(engine, monkeypatch):
    """The check above can fail: with `KETTLE_TUNING=batch-invariant=off` the rows layout's rows take the float32
    tiles and panels or the int16 path by the step's row count (lanes compute a row alike either way)."""
    if next(m for m in engine.runner.model.modules() if hasattr(m, "lanes")).lanes:
        pytest.skip("lanes keep one row's arithmetic at any row count with or without the switch")
    monkeypatch.setenv("KETTLE_TUNING", "batch-invariant=off,float-rows=3")  # the tiny batch reaches the float32 tiles
    alone, together = alone_and_together(engine, sampled=False)
    assert together != alone
