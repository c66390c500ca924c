"""Encoder-decoder models through the seq2seq path: a tiny random T5 against transformers' `generate`."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from kettle.proto import generate_pb2 as pb
from kettle.shard.seq2seq_runner import Seq2SeqRunner
from tests.models.engine_driver import join_mid_batch, make_batch, run_to_end, warm_engine
from tests.models.fallback_helpers import PROMPTS, make_tiny_t5

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def t5_path(tmp_path_factory):
    return make_tiny_t5(tmp_path_factory.mktemp("t5"))


@pytest.fixture(scope="module")
def served(t5_path):
    return warm_engine(t5_path)


@pytest.fixture(scope="module")
def hf(t5_path):
    tokenizer = AutoTokenizer.from_pretrained(t5_path)
    model = AutoModelForSeq2SeqLM.from_pretrained(t5_path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # always n tokens, so whole sequences compare
    return tokenizer, model


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)
    return out[0, 1:].tolist()  # without the decoder start token


def test_info_reports_the_seq2seq_path(served):
    engine, info = served
    assert info.execution_path == "seq2seq" and info.model_type == "t5"
    assert isinstance(engine.runner, Seq2SeqRunner)


def test_batched_greedy_equals_transformers(served, hf):
    engine, _ = served
    tokenizer, model = hf
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    texts: dict[int, str] = {}
    tokens = run_to_end(engine, make_batch(1, prompts, first_id=1, max_new_tokens=NEW_TOKENS), texts)
    for i, ids in enumerate(prompts):
        expected = hf_greedy(model, ids, NEW_TOKENS)
        assert tokens[1 + i] == expected, PROMPTS[i]
        # The text is the decoder's output alone, never a continuation of the prompt.
        assert texts[1 + i] == tokenizer.decode(expected, skip_special_tokens=True)
    assert not engine.runner._seqs  # finished requests dropped their encoder output and caches


def test_request_joining_a_running_batch(served, hf):
    engine, _ = served
    tokenizer, model = hf
    a, b = (tokenizer(p).input_ids for p in PROMPTS[1:])
    tokens = join_mid_batch(engine, a, b, NEW_TOKENS, base_id=20)
    assert tokens[20] == hf_greedy(model, a, NEW_TOKENS)
    assert tokens[21] == hf_greedy(model, b, NEW_TOKENS)


def test_first_step_logprob_and_decoder_input_details(served, hf):
    engine, _ = served
    tokenizer, model = hf
    ids = tokenizer(PROMPTS[1]).input_ids
    batch = make_batch(3, [ids], first_id=30, max_new_tokens=1, prefill_logprobs=True)
    generation = engine.prefill(pb.PrefillRequest(batch=batch)).generations[0]
    start = model.config.decoder_start_token_id
    assert list(generation.prefill_tokens.ids) == [start] and math.isnan(generation.prefill_tokens.logprobs[0])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), decoder_input_ids=torch.tensor([[start]])).logits[0, -1]
    token = generation.tokens.ids[0]
    assert token == int(logits.argmax())
    assert generation.tokens.logprobs[0] == pytest.approx(float(torch.log_softmax(logits, -1)[token]), abs=1e-4)


def test_repetition_penalty_applies_to_the_decoder_ids_as_transformers_does(served, hf):
    engine, _ = served
    tokenizer, model = hf
    # Prompts that contain the tokens the decoder will choose: penalizing the prompt too would change them.
    prompts = [ids + hf_greedy(model, ids, 4) for ids in (tokenizer(p).input_ids for p in PROMPTS[1:])]
    batch = make_batch(4, prompts, first_id=40, max_new_tokens=NEW_TOKENS)
    for request in batch.requests:
        request.parameters.repetition_penalty = 3.0
    tokens = run_to_end(engine, batch)
    for i, ids in enumerate(prompts):
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(x, max_new_tokens=NEW_TOKENS, do_sample=False, repetition_penalty=3.0)
        assert tokens[40 + i] == out[0, 1:].tolist()
