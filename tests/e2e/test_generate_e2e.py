"""End to end on the tiny model: the real launcher, shard and router, driven by HTTP and real clients."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.faults import fault_prompt

PROMPTS = [
    "The capital of France is",
    "Hello",
    "def add(a, b):\n    return a + b\n\nLarge language models generate text one token at a time.",
    "你好，世界！",
    "Numbers 0 1 2 3",
    "Emoji: 😀 🎉",
    "How are you today?",
    "The capital of Germany is Berlin. The capital of France is",
]


def generate(url: str, inputs: str, **parameters) -> httpx.Response:
    return httpx.post(f"{url}/generate", json={"inputs": inputs, "parameters": parameters}, timeout=60)


def stream_events(url: str, inputs: str, **parameters) -> list[dict]:
    body = {"inputs": inputs, "parameters": parameters}
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data:") for line in lines)
    return [json.loads(line.removeprefix("data:")) for line in lines]


@pytest.fixture(scope="module")
def reference(tiny_llama_path):
    """transformers' greedy tokens for PROMPTS (the reference the server must reproduce)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    out = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(ids))
        out[prompt] = gen[0, ids.shape[1] :].tolist()
    return out


def test_greedy_generate_matches_transformers(tiny_server, reference):
    response = generate(tiny_server.url, PROMPTS[0], max_new_tokens=16, details=True)
    assert response.status_code == 200, response.text
    body = response.json()
    ids = [t["id"] for t in body["details"]["tokens"]]
    assert ids == reference[PROMPTS[0]][: len(ids)]
    assert body["details"]["generated_tokens"] == len(ids)
    assert body["details"]["finish_reason"] in ("length", "eos_token")
    assert body["details"]["seed"] is None
    assert int(response.headers["x-generated-tokens"]) == len(ids)


def test_concurrent_requests_equal_requests_alone(tiny_server, reference):
    async def run_all():
        async with httpx.AsyncClient(timeout=120) as client:
            calls = [
                client.post(
                    f"{tiny_server.url}/generate",
                    json={"inputs": p, "parameters": {"max_new_tokens": 16, "details": True}},
                )
                for p in PROMPTS
            ]
            return await asyncio.gather(*calls)

    responses = asyncio.run(run_all())
    for prompt, response in zip(PROMPTS, responses, strict=True):
        assert response.status_code == 200, response.text
        ids = [t["id"] for t in response.json()["details"]["tokens"]]
        alone = generate(tiny_server.url, prompt, max_new_tokens=16, details=True).json()
        assert ids == [t["id"] for t in alone["details"]["tokens"]]
        assert ids == reference[prompt][: len(ids)]


def test_stream_concatenates_to_generated_text(tiny_server):
    events = stream_events(tiny_server.url, PROMPTS[3], max_new_tokens=12, details=True)
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    assert all(e["generated_text"] is None for e in events[:-1])
    last = events[-1]
    assert last["details"]["generated_tokens"] == len(events)
    assert last["details"]["input_length"] > 0
    text = "".join(e["token"]["text"] for e in events if not e["token"]["special"])
    assert text == last["generated_text"]


def test_seeded_sampling_is_reproducible_in_a_batch(tiny_server):
    params = {"max_new_tokens": 12, "do_sample": True, "seed": 42, "temperature": 0.8, "top_k": 20}
    alone = generate(tiny_server.url, PROMPTS[1], **params).json()["generated_text"]

    async def batched():
        async with httpx.AsyncClient(timeout=120) as client:
            calls = [
                client.post(f"{tiny_server.url}/generate", json={"inputs": p, "parameters": params})
                for p in [PROMPTS[1], *PROMPTS[4:7]]
            ]
            return await asyncio.gather(*calls)

    responses = asyncio.run(batched())
    assert responses[0].json()["generated_text"] == alone


def test_validation_errors(tiny_server):
    cases = [
        ({"temperature": 0}, "Input validation error: `temperature` must be strictly positive"),
        ({"top_p": 1.0}, "Input validation error: `top_p` must be > 0.0 and < 1.0"),
        ({"max_new_tokens": 0}, "Input validation error: `max_new_tokens` must be strictly positive"),
        ({"max_new_tokens": 1000}, "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 256."),
    ]
    for parameters, message in cases:
        response = generate(tiny_server.url, "Hello", **parameters)
        assert response.status_code == 422
        body = response.json()
        assert body["error_type"] == "validation"
        assert body["error"].startswith(message)
    empty = generate(tiny_server.url, "")
    assert empty.status_code == 422
    assert empty.json()["error"] == "Input validation error: `inputs` cannot be empty"


def test_protocol_errors(tiny_server):
    url = f"{tiny_server.url}/generate"
    malformed = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert malformed.status_code == 400
    wrong_type = httpx.post(url, content=b"inputs=hi", headers={"content-type": "text/plain"})
    assert wrong_type.status_code == 415
    too_big = httpx.post(url, json={"inputs": "a" * 2_100_000})
    assert too_big.status_code == 413


def test_shard_failure_fails_only_its_batch(tiny_server):
    failed = generate(tiny_server.url, fault_prompt("decode"), max_new_tokens=4)
    assert failed.status_code == 424
    assert failed.json()["error_type"] == "generation"
    assert failed.json()["error"].startswith("Request failed during generation: ")
    ok = generate(tiny_server.url, "Hello", max_new_tokens=4)
    assert ok.status_code == 200
    assert httpx.get(f"{tiny_server.url}/health").status_code == 200


def test_client_disconnect_mid_stream_does_not_harm_others(tiny_server, reference):
    body = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 200, "stop": ["never-seen"]}}
    with httpx.stream("POST", f"{tiny_server.url}/generate_stream", json=body, timeout=60) as response:
        for i, _line in enumerate(response.iter_lines()):
            if i >= 3:
                break  # leave mid-stream: the server must drop the request and free its blocks
    response = generate(tiny_server.url, PROMPTS[0], max_new_tokens=16, details=True)
    assert [t["id"] for t in response.json()["details"]["tokens"]] == reference[PROMPTS[0]][:16][
        : response.json()["details"]["generated_tokens"]
    ]
    metrics = httpx.get(f"{tiny_server.url}/metrics").text
    assert "tgi_request_count" in metrics


def test_text_generation_client(tiny_server, reference):
    from text_generation import Client

    client = Client(tiny_server.url, timeout=60)
    response = client.generate(PROMPTS[0], max_new_tokens=16)
    assert [t.id for t in response.details.tokens] == reference[PROMPTS[0]][: response.details.generated_tokens]
    pieces = list(client.generate_stream(PROMPTS[0], max_new_tokens=16))
    assert pieces[-1].generated_text == response.generated_text
    assert [p.token.id for p in pieces] == [t.id for t in response.details.tokens]


def test_info_and_health(tiny_server):
    info = httpx.get(f"{tiny_server.url}/info").json()
    assert info["max_total_tokens"] == 256
    assert info["max_input_tokens"] == 200
    assert info["model_device_type"] == "cpu"
    # float32 weights stay oneDNN-packed (faster layer by layer), and /info says so.
    assert info["decode_path"].startswith("layer by layer (the fused CPU step does not take float32 weights in")
    assert httpx.get(f"{tiny_server.url}/health").status_code == 200
    openapi = httpx.get(f"{tiny_server.url}/api-doc/openapi.json").json()
    assert "/generate" in openapi["paths"]
