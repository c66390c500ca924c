"""The drain's deadline: requests still running or queued when `--graceful-termination-timeout` passes end with
TGI's error (an error event on a stream, a JSON error on a plain request), never with a silent cut, and the whole
process tree exits within the deadline and a second.

The bundled model, 16 requests running (`--max-batch-size 16`) and 30 queued behind them, streams and plain
requests mixed; SIGTERM once all 16 run, with a 2-second deadline none of them can finish within.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import dataclass

import httpx
import pytest

from kettle.bench.process import KettleServer

pytestmark = pytest.mark.e2e

DEADLINE_S = 2.0
RUNNING = 16
QUEUED = 30
# Far more tokens than a CPU decodes in the deadline, so every request is still running (or waiting) then; the
# model counts on from the prompt rather than stopping early.
LONG = 3000
BODY = {"inputs": "1, 2, 3, 4, 5, 6, 7, 8,", "parameters": {"max_new_tokens": LONG}}


@dataclass
class Outcome:
    """How one request ended, as its client saw it."""

    stream: bool
    status: int
    events: list[dict]  # a stream's events; a plain request's one JSON body
    content_type: str


async def _stream(client: httpx.AsyncClient, url: str, started: asyncio.Event) -> Outcome:
    events: list[dict] = []
    async with client.stream("POST", f"{url}/generate_stream", json=BODY) as response:
        try:
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
                    started.set()
        except httpx.RemoteProtocolError:  # the connection closed mid-stream: the cut this test is about
            pass
    return Outcome(True, response.status_code, events, response.headers.get("content-type", ""))


async def _plain(client: httpx.AsyncClient, url: str) -> Outcome:
    response = await client.post(f"{url}/generate", json=BODY)
    kind = response.headers.get("content-type", "")
    body = response.json() if kind.startswith("application/json") else {"text": response.text}
    return Outcome(False, response.status_code, [body], kind)


async def _scenario(server: KettleServer) -> tuple[list[Outcome], float]:
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as client:
        # The first 16 (12 streams, 4 plain) take the whole batch; the 30 behind them wait in the queue.
        started = [asyncio.Event() for _ in range(12)]
        running = [asyncio.ensure_future(_stream(client, server.url, e)) for e in started]
        running += [asyncio.ensure_future(_plain(client, server.url)) for _ in range(RUNNING - 12)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        queued = [asyncio.ensure_future(_stream(client, server.url, asyncio.Event())) for _ in range(20)]
        queued += [asyncio.ensure_future(_plain(client, server.url)) for _ in range(QUEUED - 20)]
        await _wait_queued(client, server.url, QUEUED)
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        outcomes = list(await asyncio.gather(*running, *queued))
    await asyncio.to_thread(server.process.wait, 30)
    return outcomes, time.monotonic() - signalled


async def _wait_queued(client: httpx.AsyncClient, url: str, count: int) -> None:
    """Until the router's queue holds `count` requests (its /metrics gauge)."""
    for _ in range(600):
        text = (await client.get(f"{url}/metrics")).text
        sizes = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("tgi_queue_size ")]
        if sizes and sizes[0] >= count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the queue never reached {count} requests")


def _ended_visibly(outcome: Outcome) -> bool:
    if outcome.stream:  # the last event is a final one (the text) or TGI's error event
        last = outcome.events[-1] if outcome.events else {}
        return last.get("generated_text") is not None or set(last) == {"error", "error_type"}
    body = outcome.events[0]
    return outcome.content_type.startswith("application/json") and (
        "generated_text" in body or set(body) == {"error", "error_type"}
    )


def test_requests_in_flight_at_the_deadline_end_with_an_error_and_the_tree_exits_in_time():
    server = KettleServer(
        None,
        *("--max-batch-size", str(RUNNING), "--max-concurrent-requests", "64"),
        *("--graceful-termination-timeout", str(int(DEADLINE_S))),
    )
    try:
        outcomes, exit_after = asyncio.run(_scenario(server))
    finally:
        server.stop()
    logs = server.logs()
    assert server.process.returncode == 0, logs
    cut = [o for o in outcomes if not _ended_visibly(o)]
    assert not cut, f"{len(cut)} of {len(outcomes)} requests ended with no final or error event: {cut[:3]}"
    errors = [o.events[-1] for o in outcomes if "error" in o.events[-1]]
    # Nothing here can finish 3000 tokens in 2 s: every one of the 46 ends with the shutdown's error.
    assert len(errors) == RUNNING + QUEUED, [o.events[-1] for o in outcomes if "error" not in o.events[-1]]
    assert {e["error_type"] for e in errors} == {"unavailable"}
    assert {o.status for o in outcomes if not o.stream} == {503}
    assert all(o.status == 200 for o in outcomes if o.stream)
    assert exit_after < DEADLINE_S + 1.0, f"the process tree exited {exit_after:.2f} s after SIGTERM:\n{logs}"
    print(f"drain: {len(errors)} requests ended with the shutdown's error; tree gone {exit_after:.2f} s after SIGTERM")
