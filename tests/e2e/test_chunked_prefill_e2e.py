"""Chunked prefill end to end: transformers' greedy tokens (and prompt logprobs) with and without chunking and
prefix caching, on the real launcher → shard → router, with long prompts arriving while other requests decode."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kettle.bench.process import KettleServer

BUDGET = "16"  # prefill tokens per forward: every prompt below is longer, most by several chunks
PREFIXES = ("The capital of France is Paris. " * 5, "Large language models generate text one token at a time. " * 3)
SUFFIXES = ("What next?", "Hello world! How are you today?", "Numbers 0 1 2 3 4 5", "def add(a, b):")
PROMPTS = [prefix + suffix for prefix in PREFIXES for suffix in SUFFIXES]
BACKGROUND = ["Hello world!", "你好，世界！", "Emoji: 😀 🎉"]  # short prompts that decode throughout
NEW_TOKENS = {**dict.fromkeys(PROMPTS, 8), **dict.fromkeys(BACKGROUND, 40)}
# A float32 KV cache (the CPU's default is float16): prompt logprobs are compared with transformers' float32.
FLAGS = ("--max-input-tokens", "200", "--max-total-tokens", "256", "--num-threads", "1", "--kv-cache-dtype", "float32")
_HIT_TOKENS = re.compile(r"^kettle_prefix_cache_hit_tokens_total (\S+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def reference(tiny_llama_path) -> dict[str, tuple[list[int], list[int], list[float]]]:
    """transformers' greedy tokens, prompt ids and prompt-token logprobs for every prompt."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    out = {}
    for prompt, new in NEW_TOKENS.items():
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=new, do_sample=False, attention_mask=torch.ones_like(ids))
            logprobs = torch.log_softmax(model(ids).logits[0, :-1], dim=-1)
        chosen = logprobs.gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1)
        out[prompt] = (gen[0, ids.shape[1] :].tolist(), ids[0].tolist(), chosen.tolist())
    return out


async def _generate(client: httpx.AsyncClient, url: str, prompt: str, details: bool, delay: float) -> dict:
    await asyncio.sleep(delay)
    parameters = {"max_new_tokens": NEW_TOKENS[prompt], "details": True, "decoder_input_details": details}
    response = await client.post(f"{url}/generate", json={"inputs": prompt, "parameters": parameters})
    assert response.status_code == 200, response.text
    return {"prompt": prompt, **response.json()["details"]}


async def _workload(url: str) -> list[dict]:
    """Two waves; in each, background requests start first and the long prompts join, a few at a time, while
    they decode. Wave 1 asks for prompt logprobs (which turns prefix reuse off), wave 2 repeats the prompts
    without, so there they reuse the cached prefixes of wave 1."""
    results = []
    async with httpx.AsyncClient(timeout=120) as client:
        for details in (True, False):
            calls = [_generate(client, url, p, details, 0.0) for p in BACKGROUND]
            calls += [_generate(client, url, p, details, 0.05 + 0.02 * i) for i, p in enumerate(PROMPTS)]
            results += await asyncio.gather(*calls)
    return results


def _hit_tokens(url: str) -> float:
    match = _HIT_TOKENS.search(httpx.get(f"{url}/metrics", timeout=10).text)
    return float(match.group(1)) if match else 0.0


def _check(results: list[dict], reference: dict) -> None:
    for got in results:
        tokens, prompt_ids, prompt_logprobs = reference[got["prompt"]]
        assert [t["id"] for t in got["tokens"]] == tokens, got["prompt"]
        if got.get("prefill"):
            assert [t["id"] for t in got["prefill"]] == prompt_ids and got["prefill"][0]["logprob"] is None
            logprobs = [t["logprob"] for t in got["prefill"][1:]]
            assert logprobs == pytest.approx(prompt_logprobs, abs=1e-3)


def test_chunked_prefill_with_prefix_caching_matches_transformers(tiny_llama_path, reference):
    server = KettleServer(str(tiny_llama_path), *FLAGS, "--max-batch-prefill-tokens", BUDGET)
    try:
        results = asyncio.run(_workload(server.url))
        hits = _hit_tokens(server.url)
    finally:
        assert server.stop() == 0, server.logs()
    _check(results, reference)
    assert hits >= len(PROMPTS) * 16, "wave 2 did not reuse the prefixes of wave 1"


def test_unchunked_without_prefix_caching_matches_transformers(tiny_llama_path, reference):
    flags = ("--disable-chunked-prefill", "--disable-prefix-caching")
    server = KettleServer(str(tiny_llama_path), *FLAGS, *flags)
    try:
        results = asyncio.run(_workload(server.url))
    finally:
        assert server.stop() == 0, server.logs()
    _check(results, reference)


def test_session_server_defaults_match_transformers(tiny_server, reference):
    """Chunking and prefix caching on, default budget: long prompts arriving together are split at its edge."""
    _check(asyncio.run(_workload(tiny_server.url)), reference)
