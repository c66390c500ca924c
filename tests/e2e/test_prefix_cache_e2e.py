"""Prefix caching end to end: a prompt that reuses cached KV blocks generates exactly what a full prefill does."""

from __future__ import annotations

import re

import httpx

# Long enough for several 16-token KV blocks under the tiny tokenizer, unique to this module so that
# whatever other tests left in the session server's cache cannot change what is a hit here.
PREFIX = "Prefix-cache module. System: you answer briefly and carefully, citing sources when asked. " * 2
_HIT_TOKENS = re.compile(r"^kettle_prefix_cache_hit_tokens_total (\S+)$", re.MULTILINE)


def greedy_ids(url: str, inputs: str, **parameters) -> list[int]:
    body = {"inputs": inputs, "parameters": {"max_new_tokens": 12, "details": True, **parameters}}
    response = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return [t["id"] for t in response.json()["details"]["tokens"]]


def hit_tokens(url: str) -> float:
    match = _HIT_TOKENS.search(httpx.get(f"{url}/metrics", timeout=10).text)
    assert match, "the prefix cache counter is missing from /metrics"
    return float(match.group(1))


def test_cache_hits_generate_the_same_tokens_as_full_prefills(tiny_server):
    url = tiny_server.url
    before = hit_tokens(url)
    first = greedy_ids(url, PREFIX + "What is a kettle?")  # a miss: computes and caches the prefix
    assert hit_tokens(url) == before
    again = greedy_ids(url, PREFIX + "What is a kettle?")  # the same prompt: every full block but the last
    other = greedy_ids(url, PREFIX + "Name three teas.")  # the shared prefix only
    after = hit_tokens(url)
    assert after - before >= 2 * 16 * 2  # both requests reused at least two blocks of 16 tokens
    # decoder_input_details turns reuse off: these are full prefills of the same prompts.
    assert greedy_ids(url, PREFIX + "What is a kettle?", decoder_input_details=True) == first == again
    assert greedy_ids(url, PREFIX + "Name three teas.", decoder_input_details=True) == other
    assert hit_tokens(url) == after
