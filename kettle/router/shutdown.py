"""Graceful shutdown: on SIGTERM the router drains before it stops.

Draining means: requests already in flight (streams included) run to their end; every new request on a
generation route gets 503 in TGI's error shape, and `/health` answers 503, so a load balancer takes the replica
out while it finishes; `/info` and `/metrics` keep answering. The listener stays open meanwhile (a closed port
would look like a crash to clients and probes). Once nothing is in flight, or `--graceful-termination-timeout`
has passed, uvicorn shuts down (server.py), and the process exits with code 0.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kettle.router.errors import error_body

logger = logging.getLogger(__name__)

HEALTH_PATHS = frozenset({"/health", "/", "/ping"})
# Routes that keep answering normally while draining: what an operator watches the drain with.
OPEN_PATHS = frozenset({"/info", "/metrics"})
SHUTTING_DOWN = "Server is shutting down"


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

    def finished(self) -> bool:
        """True once draining has begun and nothing is in flight, or its time is up."""
        if self.deadline is None:
            return False
        if self.in_flight == 0:
            logger.info("Drained: no request in flight")
            return True
        if time.monotonic() >= self.deadline:
            logger.warning("Graceful termination timeout: %d request(s) still in flight are cut", self.in_flight)
            return True
        return False


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

    uvicorn would also re-raise the signal once it has shut down, killing the process before the scheduler
    stops and the shard channels close; here the signal only starts the graceful shutdown.
    """

    def __init__(self, config: uvicorn.Config, drain: Drain, timeout: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.timeout = timeout
        self._stop_requested = False

    def handle_exit(self, sig: int, frame: object) -> None:
        # A signal handler: it only sets flags (logging here could interleave); on_tick acts within 0.1 s.
        if self._stop_requested:
            super().handle_exit(sig, frame)
        self._stop_requested = True

    async def on_tick(self, counter: int) -> bool:
        if self._stop_requested:
            self.drain.begin(self.timeout)
            if self.drain.finished():
                return True
        return await super().on_tick(counter)

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
