"""`--speculate 4` through the real launcher, shard and router: /info reports it, greedy answers (plain,
streamed, batched with requests that do not draft, with a grammar) equal those of the server without it, and
200 mixed requests (sampled, streamed, cancelled mid-stream) leave every KV block free."""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kettle.bench.process import KettleServer
from tests.e2e.kv_pool import assert_pool_whole, metric

COPY = "Repeat after me: the kettle sings, the kettle sings, the kettle sings on the stove. " * 2
PROMPTS = [COPY, "Hello there", "1 2 3 4 1 2 3 4 1 2 3 4", "abc abc abc abc"]


# The tiny random model never repeats two tokens of its context: its server drafts from 1-gram matches, every
# step in full, within 7 rows (so that batches draft too), so that steps verify (and accept) drafts; the default
# drafting policy is tested in process.
DRAFT_EVERY_STEP = {"KETTLE_TUNING": "speculate-min-ngram=1,speculate-row-cost=0,speculate-step-rows=7"}


@pytest.fixture(scope="module")
def speculating_server(tiny_llama_path):
    server = KettleServer(
        str(tiny_llama_path),
        *("--max-input-tokens", "200", "--max-total-tokens", "256", "--speculate", "4"),
        env=DRAFT_EVERY_STEP,
    )
    yield server
    try:
        assert_pool_whole(server.url)
    finally:
        code = server.stop()
    assert code == 0, f"launcher exited with {code}:\n{server.logs()}"


def generate(url: str, inputs: str, **parameters) -> tuple[list[int], str]:
    body = {"inputs": inputs, "parameters": {"max_new_tokens": 40, "details": True, **parameters}}
    response = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    return [t["id"] for t in answer["details"]["tokens"]], answer["generated_text"]


def stream(url: str, inputs: str, **parameters) -> list[int]:
    body = {"inputs": inputs, "parameters": {"max_new_tokens": 40, **parameters}}
    ids = []
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                ids.append(httpx.Response(200, content=line[5:]).json()["token"]["id"])
    return ids


def batch(url: str) -> list:
    """The prompts at once (so they share steps), one with a repetition penalty (it never drafts) and one with
    a grammar."""
    jobs = [(p, {}) for p in PROMPTS] + [(COPY, {"repetition_penalty": 1.2})]
    jobs.append(("Give a word:", {"grammar": {"type": "regex", "value": "[a-z]{2,12}"}}))
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: generate(url, job[0], **job[1]), jobs))


def test_info_reports_speculate(speculating_server, tiny_server):
    assert httpx.get(f"{speculating_server.url}/info").json()["speculate"] == 4
    assert httpx.get(f"{tiny_server.url}/info").json()["speculate"] == 0


def test_greedy_with_speculation_equals_greedy_without(speculating_server, tiny_server):
    drafted = metric(speculating_server.url, "kettle_speculative_draft_tokens")
    assert batch(speculating_server.url) == batch(tiny_server.url)
    for prompt in PROMPTS:
        assert stream(speculating_server.url, prompt) == stream(tiny_server.url, prompt)
    assert metric(speculating_server.url, "kettle_speculative_draft_tokens") > drafted
    assert metric(speculating_server.url, "kettle_speculative_accepted_tokens") > 0


def test_200_mixed_requests_leave_every_block_free(speculating_server):
    async def one(client: httpx.AsyncClient, i: int, rng: random.Random) -> None:
        parameters = {"max_new_tokens": rng.randint(1, 30)}
        if rng.random() < 0.5:
            parameters |= {"do_sample": True, "temperature": rng.choice([0.3, 1.0]), "seed": i}
        body = {"inputs": rng.choice(PROMPTS)[: rng.randint(5, 120)], "parameters": parameters}
        if rng.random() < 0.3:  # streamed, and sometimes abandoned after a few tokens
            async with client.stream("POST", "/generate_stream", json=body) as response:
                stop_after = rng.choice([2, 5, 1000])
                async for n, _ in _numbered(response.aiter_lines()):
                    if n >= stop_after:
                        break
        else:
            response = await client.post("/generate", json=body)
            assert response.status_code == 200, response.text

    async def main() -> None:
        rng = random.Random(0)
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(base_url=speculating_server.url, timeout=120, limits=limits) as client:
            await asyncio.gather(*(one(client, i, rng) for i in range(200)))

    asyncio.run(main())
    assert_pool_whole(speculating_server.url)


async def _numbered(lines):
    n = 0
    async for line in lines:
        if line.startswith("data:"):
            n += 1
            yield n, line
