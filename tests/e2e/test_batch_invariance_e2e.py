"""Batch invariance through the real launcher, shard and router (`KETTLE_TUNING`'s `batch-invariant`, on by default): 24
distinct requests sent together get the tokens, and the logprobs to the last bit, that each gets sent alone,
greedy and seeded, on the bundled model with `--speculate 4`. Alone, the copying requests draft and verify drafts
(rows of a speculative step) and every prompt is computed in a chunk of its own (or partly from the prefix cache);
together, no request drafts (the step is full) and the prompts share one chunk of several hundred rows. The
logprobs make the check sharp: a row computed with other arithmetic moves them even where no token flips."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kettle.bench.process import KettleServer
from tests.e2e.kv_pool import assert_pool_whole, metric

TOPICS = ["tea", "rivers", "the moon", "bread", "trains", "winter", "bees", "maps", "clocks", "gardens", "salt", "owls"]
PASSAGES = [
    "The kettle boils water for tea. It sings when the water is hot, and then it clicks off.",
    "Seven swans swim on the lake at dawn, and the mist lifts slowly from the reeds.",
    "A red fox ran across the field, jumped the old stone wall and vanished into the wood.",
]
# Twelve stories and twelve copies (the copies draft when alone: their answers repeat their prompts).
PROMPTS = [f"Here is a long story about {topic}. Once upon a time," for topic in TOPICS]
PROMPTS += [f"Repeat exactly, twice: {PASSAGES[i % 3]} ({i})" for i in range(12)]
TOKENS = 48


@pytest.fixture(scope="module")
def server():
    server = KettleServer(None, "--speculate", "4")
    yield server
    try:
        assert_pool_whole(server.url)
    finally:
        code = server.stop()
    assert code == 0, f"launcher exited with {code}:\n{server.logs()}"


def generate(url: str, prompt: str, parameters: dict) -> tuple[str, list[tuple[int, float]]]:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": TOKENS, "details": True, **parameters}}
    response = httpx.post(f"{url}/generate", json=body, timeout=300)
    assert response.status_code == 200, response.text
    answer = response.json()
    return answer["generated_text"], [(t["id"], t["logprob"]) for t in answer["details"]["tokens"]]


@pytest.mark.parametrize("sampling", [{}, {"do_sample": True, "temperature": 0.8}], ids=["greedy", "seeded"])
def test_requests_get_the_same_tokens_alone_and_together(server, sampling):
    jobs = [{**sampling, "seed": i} if sampling else {} for i in range(len(PROMPTS))]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda i: generate(server.url, PROMPTS[i], jobs[i]), range(len(PROMPTS))))
    drafted = metric(server.url, "kettle_speculative_draft_tokens")
    alone = [generate(server.url, prompt, job) for prompt, job in zip(PROMPTS, jobs, strict=True)]
    assert metric(server.url, "kettle_speculative_draft_tokens") > drafted  # alone, the copies drafted
    assert sum(len(tokens) == TOKENS for _, tokens in alone) >= 20  # (a few copies may end early)
    differ = [i for i in range(len(PROMPTS)) if alone[i] != together[i]]
    assert differ == [], [(PROMPTS[i], alone[i][0], together[i][0]) for i in differ]
