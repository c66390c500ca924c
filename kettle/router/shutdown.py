"""Graceful shutdown: on SIGTERM the router drains before it stops.

Draining means: requests already in flight (streams included) run to their end; every new request on a
generation route gets 503 in TGI's error shape, and `/health` answers 503, so a load balancer takes the replica
out while it finishes; `/info` and `/metrics` keep answering. The listener stays open meanwhile (a closed port
would look like a crash to clients and probes). Once nothing is in flight, uvicorn shuts down (server.py), and the
process exits with code 0.

When `--graceful-termination-timeout` passes first, the router ends what is left itself before uvicorn closes
anything: every request still running or queued gets TGI's error (`ShuttingDown`: an error event on a stream, a
503 JSON answer on a plain request), and the handlers get a moment to write it. Closing uvicorn first would
cancel the handlers mid-answer: a stream would stop after a plain token event, and a client could not tell a cut
answer from a short one.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import uvicorn
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kettle.router.errors import error_body
from kettle.router.types import SHUTTING_DOWN

logger = logging.getLogger(__name__)

HEALTH_PATHS = frozenset({"/health", "/", "/ping"})
# Routes that keep answering normally while draining: what an operator watches the drain with.
OPEN_PATHS = frozenset({"/info", "/metrics"})
# After the deadline's errors are handed to the requests: how long their handlers get to write them before uvicorn
# closes the connections. Writing an event takes milliseconds; this only bounds a client that stopped reading.
FLUSH_SECONDS = 0.5


class Drain:
    """Whether the server is draining, and how many HTTP requests are still in flight."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.deadline: float | None = None  # monotonic; set when draining begins

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def begin(self, timeout: float) -> None:
        """Starts draining (idempotent); requests in flight get up to `timeout` seconds."""
        if self.deadline is None:
            self.deadline = time.monotonic() + timeout
            logger.info("Draining: %d request(s) in flight, new ones get 503 (up to %.0f s)", self.in_flight, timeout)

    def expired(self) -> bool:
        """True once draining has begun and its time is up."""
        return self.deadline is not None and time.monotonic() >= self.deadline


class DrainMiddleware:
    """Counts requests in flight and turns new ones away with 503 while draining."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining and scope["path"] not in OPEN_PATHS:
            await _refusal(scope)(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


def _refusal(scope: Scope) -> JSONResponse:
    if scope["method"] == "GET" and scope["path"] in HEALTH_PATHS:
        return JSONResponse(error_body("unhealthy", "healthcheck"), status_code=503)
    # Connection: close, so a keep-alive client opens its next connection to another replica.
    return JSONResponse(error_body(SHUTTING_DOWN, "unavailable"), status_code=503, headers={"connection": "close"})


class DrainingServer(uvicorn.Server):
    """uvicorn with the drain in front of its own shutdown: the first SIGINT/SIGTERM starts draining, uvicorn
    shuts down once the drain is over, and a second signal goes straight to uvicorn's shutdown.

    At the drain's deadline `end_in_flight` ends every request still in flight with an error; uvicorn shuts down
    once their handlers have answered (or after `FLUSH_SECONDS`).

    uvicorn would also re-raise the signal once it has shut down, killing the process before the scheduler
    stops and the shard channels close; here the signal only starts the graceful shutdown.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Drain,
        timeout: float,
        end_in_flight: Callable[[], Awaitable[None]],
    ) -> None:
        super().__init__(config)
        self.drain = drain
        self.timeout = timeout
        self.end_in_flight = end_in_flight
        self._stop_requested = False
        self._ended_at: float | None = None  # monotonic: when the deadline's errors were handed out

    def handle_exit(self, sig: int, frame: object) -> None:
        # A signal handler: it only sets flags (logging here could interleave); on_tick acts within 0.1 s.
        if self._stop_requested:
            super().handle_exit(sig, frame)
        self._stop_requested = True

    async def on_tick(self, counter: int) -> bool:
        if self._stop_requested:
            self.drain.begin(self.timeout)
            if await self._drained():
                return True
        return await super().on_tick(counter)

    async def _drained(self) -> bool:
        """True once nothing is in flight; at the deadline, first ends what is left, then gives it a moment."""
        if self.drain.in_flight == 0:
            logger.info("Drained: no request in flight")
            return True
        if not self.drain.expired():
            return False
        if self._ended_at is None:
            logger.warning(
                "Graceful termination timeout: %d request(s) still in flight end with an error", self.drain.in_flight
            )
            await self.end_in_flight()
            self._ended_at = time.monotonic()
        return time.monotonic() >= self._ended_at + FLUSH_SECONDS

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
