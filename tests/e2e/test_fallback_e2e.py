"""End to end through the transformers paths: the real launcher, shard and router serving a causal model with
no native implementation (GPT-Neo, padded fallback) and an encoder-decoder (T5, seq2seq), with real clients."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

from kettle.bench.process import KettleServer
from tests.models.fallback_helpers import PROMPTS, make_tiny_gpt_neo, make_tiny_t5

LIMITS = ("--max-input-tokens", "200", "--max-total-tokens", "256")


@pytest.fixture(scope="module")
def neo_path(tmp_path_factory):
    return make_tiny_gpt_neo(tmp_path_factory.mktemp("e2e-gpt-neo"))


@pytest.fixture(scope="module")
def neo_server(neo_path):
    server = KettleServer(str(neo_path), *LIMITS)
    yield server
    assert server.stop() == 0, server.logs()


def _greedy(model, tokenizer, prompt: str, n: int, skip: int | None = None) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1] if skip is None else skip :].tolist()


def test_fallback_info_generate_and_stream_with_the_client(neo_server, neo_path):
    from text_generation import Client

    info = httpx.get(f"{neo_server.url}/info").json()
    assert info["execution_path"] == "transformers"
    tokenizer = AutoTokenizer.from_pretrained(neo_path)
    model = AutoModelForCausalLM.from_pretrained(neo_path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    client = Client(neo_server.url, timeout=60)
    response = client.generate(PROMPTS[1], max_new_tokens=10, decoder_input_details=True, top_n_tokens=2)
    ids = [t.id for t in response.details.tokens]
    assert ids == _greedy(model, tokenizer, PROMPTS[1], 10)[: len(ids)]
    assert len(response.details.prefill) == len(tokenizer(PROMPTS[1]).input_ids)
    assert all(len(t) == 2 for t in response.details.top_tokens)
    pieces = list(client.generate_stream(PROMPTS[1], max_new_tokens=10))
    assert [p.token.id for p in pieces] == ids
    assert pieces[-1].generated_text == response.generated_text


def test_fallback_seeded_sampling_is_reproducible_under_concurrency(neo_server):
    """Continuous batching through the router: the same seed gives the same text whatever runs beside it."""
    body = {"max_new_tokens": 8, "do_sample": True, "temperature": 0.9, "top_k": 20, "seed": 7, "details": True}

    async def run_all() -> list[dict]:
        async with httpx.AsyncClient(timeout=120) as client:
            alone = (
                await client.post(f"{neo_server.url}/generate", json={"inputs": PROMPTS[0], "parameters": body})
            ).json()
            crowd = [
                client.post(f"{neo_server.url}/generate", json={"inputs": p, "parameters": body | {"seed": 7 + i}})
                for i, p in enumerate(PROMPTS * 2)
            ]
            return [alone] + [r.json() for r in await asyncio.gather(*crowd)]

    results = asyncio.run(run_all())
    assert results[1]["generated_text"] == results[0]["generated_text"]
    assert results[0]["details"]["seed"] == 7
    assert all("generated_text" in r for r in results)


def test_seq2seq_server_generates_the_decoder_output(tmp_path_factory):
    from text_generation import Client

    path = make_tiny_t5(tmp_path_factory.mktemp("e2e-t5"))
    server = KettleServer(str(path), *LIMITS)
    try:
        info = httpx.get(f"{server.url}/info").json()
        assert info["execution_path"] == "seq2seq"
        assert info["model_pipeline_tag"] == "text2text-generation"
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSeq2SeqLM.from_pretrained(path, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        client = Client(server.url, timeout=60)
        response = client.generate(PROMPTS[1], max_new_tokens=8)
        ids = [t.id for t in response.details.tokens]
        assert ids == _greedy(model, tokenizer, PROMPTS[1], 8, skip=1)[: len(ids)]
        assert response.generated_text == tokenizer.decode(ids, skip_special_tokens=True)
        pieces = list(client.generate_stream(PROMPTS[1], max_new_tokens=8))
        assert [p.token.id for p in pieces] == ids
    finally:
        assert server.stop() == 0, server.logs()
