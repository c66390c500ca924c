"""Two Kettle replicas behind vllm-router (the `scale` extra) on loopback, one torch thread each.

What a deployment with N replicas relies on: both APIs pass through the router, prompts that share a prefix
reuse a replica's KV cache more than under round-robin, and a replica that dies is routed around.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI
from text_generation import Client

from kettle.bench.process import KettleServer
from tests.e2e.replica_router import ROUTER, Router, kill_hard, metric

pytestmark = pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (pip install kettle[scale])")

LIMITS = ("--max-input-tokens", "200", "--max-total-tokens", "256", "--max-concurrent-requests", "64")
HITS = "kettle_prefix_cache_hit_tokens"


@pytest.fixture(scope="module")
def replicas(tiny_llama_path):
    """Two replicas of the tiny Llama, started together, one torch thread each, no metrics listener."""
    flags = ("--num-threads", "1", "--prometheus-port", "0", *LIMITS)
    with ThreadPoolExecutor(2) as pool:
        starting = [pool.submit(KettleServer, str(tiny_llama_path), *flags, own_sockets=False) for _ in range(2)]
        outcomes = [future.exception() or future.result() for future in starting]
    servers = [outcome for outcome in outcomes if isinstance(outcome, KettleServer)]
    if len(servers) < 2:
        for server in servers:
            server.stop()
        raise next(outcome for outcome in outcomes if isinstance(outcome, BaseException))
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture
def router(replicas):
    """The router as deployed: cache-aware policy."""
    router = Router([r.url for r in replicas], "cache_aware")
    yield router
    router.stop()


def one_request(url: str, kind: str, i: int) -> str:
    """One request through the router with a real client; returns the generated text."""
    prompt = f"Request {i}: tell me about kettles."
    if kind == "tgi":
        return Client(url, timeout=60).generate(prompt, max_new_tokens=3).generated_text
    if kind == "tgi-stream":
        return "".join(r.token.text for r in Client(url, timeout=60).generate_stream(prompt, max_new_tokens=3))
    openai = OpenAI(base_url=f"{url}/v1", api_key="-", timeout=60, max_retries=0)
    if kind == "chat":
        messages = [{"role": "user", "content": prompt}]
        return openai.chat.completions.create(model="tgi", messages=messages, max_tokens=3).choices[0].message.content
    return openai.completions.create(model="tgi", prompt=prompt, max_tokens=3).choices[0].text


def test_forty_requests_over_both_apis_all_succeed(router, replicas):
    before = sum(metric(r, "tgi_request_success") for r in replicas)
    kinds = itertools.islice(itertools.cycle(["tgi", "tgi-stream", "chat", "completions"]), 40)
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda job: one_request(router.url, *job), zip(kinds, range(40), strict=True)))
    assert len(texts) == 40 and all(isinstance(text, str) for text in texts)
    assert sum(metric(r, "tgi_request_success") for r in replicas) - before == 40


def prefix_hits(replicas: list[KettleServer], url: str, run: str) -> float:
    """Prefix-cache hit tokens over all replicas for 12 requests: 3 long shared prefixes, interleaved."""
    before = sum(metric(r, HITS) for r in replicas)
    for i in range(12):
        prefix = f"{run} {['alpha', 'bravo', 'charlie'][i % 3]} " * 12
        body = {"model": "tgi", "prompt": f"{prefix} question {i}", "max_tokens": 1}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    return sum(metric(r, HITS) for r in replicas) - before


def test_shared_prefixes_hit_the_cache_more_than_under_round_robin(replicas):
    measured = {}
    for policy in ("round_robin", "cache_aware"):
        router = Router([r.url for r in replicas], policy)
        try:
            measured[policy] = prefix_hits(replicas, router.url, run=policy[:2])
        finally:
            router.stop()
    assert measured["cache_aware"] > measured["round_robin"], measured


def serving(replicas: list[KettleServer]) -> KettleServer:
    """The replica with a request in its running batch."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for replica in replicas:
            if metric(replica, "tgi_batch_current_size") > 0:
                return replica
        time.sleep(0.05)
    raise AssertionError("no replica is running the stream")


def test_a_killed_replica_is_routed_around(router, replicas):
    """The replica serving a long stream (and the traffic beside it) is SIGKILLed. The stream in flight is cut:
    it ends without its final event (its first bytes were sent, so the router cannot replay it). Every request
    sent after the kill succeeds on the other replica."""
    outcomes: list[tuple[float, bool]] = []
    stop = threading.Event()

    def traffic() -> None:
        for i in itertools.count():
            if stop.is_set():
                return
            sent = time.monotonic()
            try:
                one_request(router.url, "completions", i)
                outcomes.append((sent, True))
            except Exception:
                outcomes.append((sent, False))

    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 240}}
    with (
        ThreadPoolExecutor(2) as pool,
        httpx.stream("POST", f"{router.url}/generate_stream", json=body, timeout=60) as stream,
    ):
        lines = stream.iter_lines()
        assert next(lines).startswith("data:")
        victim = serving(replicas)  # the stream's replica: nothing else runs yet
        workers = [pool.submit(traffic) for _ in range(2)]
        time.sleep(0.1)  # requests in flight at the kill, the stream with ~239 tokens to go
        kill_hard(victim)
        killed = time.monotonic()
        events: list[str] = []
        with contextlib.suppress(httpx.HTTPError):  # the connection may also just break
            events.extend(line for line in lines if line.startswith("data:"))
        time.sleep(6)
        stop.set()
        for worker in workers:
            worker.result()
    assert not any('"generated_text":"' in event for event in events), "the cut stream cannot have finished"
    later = [ok for sent, ok in outcomes if sent > killed]
    assert later and all(later), (outcomes, killed, router.logs())
