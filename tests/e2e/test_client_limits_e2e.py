"""The router against clients that cost it: prompts megabytes long, and clients that send their request slowly.

Twenty 1.9 MB prompts, each far over the token limits, used to take the router from ~150 to ~840 MB and leave it
there; they are now refused by their length before the tokenizer runs, and the router's memory stays within
100 MB of what it held idle, after 20 in a row and after 8 at once. A body sent slowly is answered 408 once its
time is up, and connections dribbling their headers are closed, each within the router's client timeout.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import psutil
import pytest

from kettle.bench.process import KettleServer
from kettle.router.slow_clients import CLIENT_TIMEOUT_S
from kettle.router.tokenizer import load_tokenizer

PROMPT_CHARS = 1_900_000
WORDS = "the kettle boils water for tea in a small kitchen at dawn "
MAX_GROWTH = 100 * 2**20


@pytest.fixture(scope="module")
def server(tiny_llama_path):
    server = KettleServer(str(tiny_llama_path), "--max-input-tokens", "200", "--max-total-tokens", "256")
    yield server
    assert server.stop() == 0, server.logs()


def router_rss(server: KettleServer) -> int:
    (router,) = [c for c in psutil.Process(server.process.pid).children(recursive=True) if "router" in c.cmdline()]
    return router.memory_info().rss


def rss_settles_below(server: KettleServer, limit: int, within: float = 10) -> int:
    """The router's resident memory once it is under `limit`, or as it is after `within` seconds."""
    deadline = time.monotonic() + within
    while (rss := router_rss(server)) > limit and time.monotonic() < deadline:
        time.sleep(0.5)
    return rss


def test_prompts_far_over_the_limits_leave_the_router_s_memory_as_it_was(server, tiny_llama_path):
    prompt = (WORDS * (PROMPT_CHARS // len(WORDS) + 1))[:PROMPT_CHARS]
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 10}}
    fewest = load_tokenizer(str(tiny_llama_path)).char_bound().fewest_tokens(prompt)
    expected = (
        "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 256. "
        f"Given: at least {fewest} `inputs` tokens and 10 `max_new_tokens`"
    )
    assert httpx.post(f"{server.url}/generate", json={"inputs": "Hello"}, timeout=60).status_code == 200
    idle = router_rss(server)
    with httpx.Client(timeout=60) as client:
        for _ in range(20):
            response = client.post(f"{server.url}/generate", json=body)
            assert response.status_code == 422
            assert response.json() == {"error": expected, "error_type": "validation"}
    after_sequential = rss_settles_below(server, idle + MAX_GROWTH)

    async def at_once() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(f"{server.url}/generate", json=body) for _ in range(8)))

    assert [r.status_code for r in asyncio.run(at_once())] == [422] * 8
    after_concurrent = rss_settles_below(server, idle + MAX_GROWTH)
    mib = {"idle": idle >> 20, "after 20": after_sequential >> 20, "after 8 at once": after_concurrent >> 20}
    assert after_sequential <= idle + MAX_GROWTH and after_concurrent <= idle + MAX_GROWTH, mib


def _dribble(sock: socket.socket, data: bytes, every: float) -> tuple[bytes, float]:
    """Sends `data` a byte every `every` seconds until the server answers or closes; returns all it sent back
    and the seconds until it did."""
    started = time.monotonic()
    for byte in data:
        sock.settimeout(every)
        try:
            sock.recv(1, socket.MSG_PEEK)  # an answer, or b"" for a closed connection: the server acted
            break
        except TimeoutError:
            sock.sendall(bytes([byte]))
    sock.settimeout(CLIENT_TIMEOUT_S + 10)
    chunks = [sock.recv(65536)]
    took = time.monotonic() - started
    while chunks[-1]:
        chunks.append(sock.recv(65536))
    return b"".join(chunks), took


def _slow_client(server: KettleServer, request: bytes, then: bytes, results: list) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(request)
        results.append(_dribble(sock, then, every=0.25))


def test_slow_senders_are_cut_within_the_client_timeout(server):
    slow_body = (
        b"POST /generate HTTP/1.1\r\nHost: kettle\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n",
        b'{"inputs": "' + b"a" * 99_990,
    )
    dribbled_headers = (b"POST /generate HTTP/1.1\r\nHost: kettle\r\n", b"X-Slow: " + b"z" * 1000)
    silent = (b"", b"")
    bodies, headers, silences = [], [], []
    threads = [threading.Thread(target=_slow_client, args=(server, *slow_body, bodies))]
    threads += [threading.Thread(target=_slow_client, args=(server, *dribbled_headers, headers)) for _ in range(20)]
    threads += [threading.Thread(target=_slow_client, args=(server, *silent, silences)) for _ in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(CLIENT_TIMEOUT_S + 20)
    assert (len(bodies), len(headers), len(silences)) == (1, 20, 5)

    ((answer, took),) = bodies
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    error = json.loads(payload)
    assert error["error_type"] == "request_timeout" and error["error"].startswith("Request body timed out")
    # The body's time: the timeout, plus a second per 64 KiB received (at 4 bytes a second, a few hundred).
    assert CLIENT_TIMEOUT_S - 0.5 < took < CLIENT_TIMEOUT_S + 3
    for answer, took in headers:
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and json.loads(payload)["error_type"] == "request_timeout"
        assert CLIENT_TIMEOUT_S - 0.5 < took < CLIENT_TIMEOUT_S + 3
    for answer, took in silences:  # no request came: closed without a word
        assert answer == b"" and CLIENT_TIMEOUT_S - 0.5 < took < CLIENT_TIMEOUT_S + 3
    assert httpx.post(f"{server.url}/generate", json={"inputs": "Hello"}, timeout=60).status_code == 200
