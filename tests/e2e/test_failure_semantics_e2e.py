"""One bad request must not hang others or leak the KV cache, over HTTP against the real server.

The reproductions that used to wedge the server, then faults injected at every stage of a request's path (see
tests/fault_site/sitecustomize.py) while other requests run and wait. Every request gets an answer within a
bound, in TGI's error shape when it fails; afterwards every KV block is free, the ledger balanced, /health is 200
and a long request succeeds.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.e2e.kv_pool import assert_pool_whole
from tests.faults import fault_prompt

ANSWER_WITHIN = 60  # seconds: any request, failed or not
LONG = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 200, "stop": ["never-seen"]}}

# (route, raw JSON body): each must be refused with a 422 that names the field.
POISONS = [
    ("/generate", '{"inputs":"Hello","parameters":{"max_new_tokens":100,"stop":["\\ud800"]}}', "parameters.stop.0"),
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"Hi"}],"stop":["\\udc00"]}', "stop.0"),
    ("/generate", '{"inputs":"Hello","parameters":{"top_k":9223372036854775808,"do_sample":true}}', "top_k"),
    ("/generate", '{"inputs":"\\ud800"}', "`inputs`"),
    ("/generate_stream", '{"inputs":"\\ud800"}', "`inputs`"),
    ("/tokenize", '{"inputs":"\\ud800"}', "`inputs`"),
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"\\ud800"}]}', "messages.0.content"),
    ("/v1/completions", '{"prompt":"\\ud800"}', "`prompt`"),
    ("/generate", '{"inputs":"Hi","parameters":{"temperature":Infinity,"do_sample":true}}', "temperature"),
    ("/generate", '{"inputs":"Hi","parameters":{"temperature":1e400,"do_sample":true}}', "temperature"),
    ("/generate", '{"inputs":"Hi","parameters":{"repetition_penalty":1e39}}', "repetition_penalty"),
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"Hi"}],"max_tokens":0}', "max_tokens"),
    ("/generate", '{"inputs":"Hi","parameters":{"seed":18446744073709551616}}', "seed"),
    ("/generate", '{"inputs":"Hi","parameters":{"max_new_tokens":4294967296}}', "max_new_tokens"),
    ("/generate", '{"inputs":"Hi","parameters":{"top_n_tokens":4294967296}}', "top_n_tokens"),
    ("/generate", '{"inputs":"Hi","parameters":{"truncate":4294967296}}', "truncate"),
    ("/generate", '{"inputs":"Hi", "parameters": ' + "[" * 5000 + "]" * 5000 + "}", None),
    (
        "/v1/chat/completions",
        '{"messages":[{"role":"user","content":"Hi"}],"tool_choice":"none","tools":[{"type":"function",'
        '"function":{"name":"f","parameters":{"type":"object","properties":{"a":{"type":"notatype"}}}}}]}',
        "`f`",
    ),
]


async def post(client: httpx.AsyncClient, route: str, body: dict | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"content-type": "application/json"}
    return await client.post(route, content=content, headers=headers, timeout=ANSWER_WITHIN)


def is_tgi_error(response: httpx.Response) -> bool:
    body = response.json()
    return set(body) == {"error", "error_type"}


@pytest.mark.parametrize(("route", "body", "field"), POISONS, ids=[f"{r}:{f}" for r, _, f in POISONS])
def test_poisoned_request_gets_4xx_and_a_request_beside_it_completes(tiny_server, route, body, field):
    async def main():
        async with httpx.AsyncClient(base_url=tiny_server.url) as client:
            normal = asyncio.create_task(
                post(client, "/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 8}})
            )
            poisoned = await post(client, route, body)
            assert 400 <= poisoned.status_code < 500, poisoned.text
            if route != "/generate_stream" or poisoned.headers["content-type"].startswith("application/json"):
                assert is_tgi_error(poisoned)
                assert field is None or field in poisoned.json()["error"]
            assert (await normal).status_code == 200
            # The same keep-alive connection still works after the refusal.
            assert (
                await post(client, "/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
            ).status_code == 200

    asyncio.run(main())


def test_after_the_poisons_the_pool_is_whole_and_a_long_request_succeeds(tiny_server):
    assert_pool_whole(tiny_server.url)
    response = httpx.post(f"{tiny_server.url}/generate", json=LONG, timeout=ANSWER_WITHIN)
    assert response.status_code == 200
    assert httpx.get(f"{tiny_server.url}/health").status_code == 200


def test_an_unauthenticated_client_gets_401_before_the_body_is_read(tiny_llama_path):
    from kettle.bench.process import KettleServer

    server = KettleServer(str(tiny_llama_path), "--api-key", "secret", "--max-total-tokens", "64")
    try:
        big = httpx.post(
            f"{server.url}/generate", content=b"{" * 3_000_000, headers={"content-type": "application/json"}
        )
        assert big.status_code == 401 and big.json()["error_type"] == "unauthorized"
        good = httpx.post(
            f"{server.url}/generate",
            json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
            headers={"authorization": "Bearer secret"},
            timeout=ANSWER_WITHIN,
        )
        assert good.status_code == 200
        assert httpx.get(f"{server.url}/health").status_code == 200  # open routes stay open
    finally:
        server.stop()


# stage -> what the faulty request gets: a failure that is its own (4xx) or of the call it was in (424, 500).
STAGES = {
    "validation": {500},
    "tokenization": {500},
    "allocation": {422},
    "batch": {422},
    "shard-request": {424},
    "prefill": {424},
    "decode": {424},
    "sampling": {424},
    "detokenize": {424},
    "stop": {424},
    "delivery": {424},
}


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("route", ["/generate", "/generate_stream"])
def test_a_fault_at_any_stage_answers_every_request_and_leaks_nothing(tiny_server, stage, route):
    async def main():
        async with httpx.AsyncClient(base_url=tiny_server.url) as client:
            running = asyncio.create_task(post(client, "/generate", LONG))
            await asyncio.sleep(0.2)  # it is decoding when the faulty request arrives
            faulty = asyncio.create_task(
                post(client, route, {"inputs": fault_prompt(stage), "parameters": {"max_new_tokens": 6}})
            )
            queued = [
                asyncio.create_task(
                    post(client, "/generate", {"inputs": f"Hi {i}", "parameters": {"max_new_tokens": 4}})
                )
                for i in range(3)
            ]
            async with asyncio.timeout(ANSWER_WITHIN):
                answers = await asyncio.gather(running, faulty, *queued)
        fault = answers[1]
        if route == "/generate_stream" and fault.status_code == 200:  # the error came as the stream's last event
            last = json.loads(fault.text.strip().split("\n\n")[-1].removeprefix("data:"))
            status = {"generation": 424, "validation": 422}.get(last.get("error_type"), 500)
            assert set(last) >= {"error", "error_type"}
        else:
            status = fault.status_code
            assert is_tgi_error(fault)
        assert status in STAGES[stage], fault.text
        for other in (answers[0], *answers[2:]):
            assert other.status_code == 200 or (other.status_code == 424 and is_tgi_error(other)), other.text
        assert_pool_whole(tiny_server.url)
        later = httpx.post(
            f"{tiny_server.url}/generate",
            json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}},
            timeout=ANSWER_WITHIN,
        )
        assert later.status_code == 200
        assert httpx.get(f"{tiny_server.url}/health", timeout=ANSWER_WITHIN).status_code == 200

    asyncio.run(main())


def test_a_failed_filter_batch_answers_its_requests(tiny_server):
    """FilterBatch runs when a client leaves: the faulty request shares the batch with a stream that is dropped."""

    async def main():
        async with httpx.AsyncClient(base_url=tiny_server.url) as client:
            faulty = asyncio.create_task(
                post(
                    client,
                    "/generate",
                    {"inputs": fault_prompt("filter"), "parameters": {"max_new_tokens": 100, "stop": ["never-seen"]}},
                )
            )
            async with client.stream("POST", "/generate_stream", json=LONG, timeout=ANSWER_WITHIN) as stream:
                async for _ in stream.aiter_lines():
                    break  # the client leaves mid-stream: the router filters it out of the shards' batch
            async with asyncio.timeout(ANSWER_WITHIN):
                answer = await faulty
        assert answer.status_code in (200, 424) and (answer.status_code == 200 or is_tgi_error(answer))
        assert_pool_whole(tiny_server.url)
        assert (
            await asyncio.to_thread(httpx.post, f"{tiny_server.url}/generate", json=LONG, timeout=ANSWER_WITHIN)
        ).status_code == 200

    asyncio.run(main())
