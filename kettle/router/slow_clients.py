"""Deadlines for slow clients: a request's headers, its body, and what is left of a body after the answer.

uvicorn reads a request for as long as its client takes: 200 connections each dribbling a header byte now and
then all stayed open, and a 1 MB body sent at 10 KB/s was read for 100 s. Each held a connection and its buffers,
and enough of them exhaust the process's file descriptors. So:

- the request line and headers must be in within `CLIENT_TIMEOUT_S` of the connection opening (of the request's
  first byte on a kept-alive connection); past it the client gets a 408 and the connection closes (silently if
  not a byte came);
- while the route waits for the body, the body must come within `CLIENT_TIMEOUT_S` plus one second per
  `MIN_BODY_RATE` bytes received: a client sending slower than that gets a 408 in TGI's error shape, and the
  connection closes;
- a body the route did not read (a 401, a 413 by Content-Length) must still finish within `CLIENT_TIMEOUT_S` of
  the answer, or the connection closes: uvicorn keeps reading it to reuse the connection, for as long as it lasts.

TGI has no such limits, and no flags for them: these are constants, chosen to let any working client through.

Time the server itself holds the client up (reading paused while pipelined requests wait their turn) does not
count: the header and leftover deadlines wait for reading to resume.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kettle.router.errors import ApiError, error_body

# A program sends its request line and headers in one write; 10 s covers retransmissions on a poor network, and is
# short enough that connections held open by dribbling bytes cannot pile up (a few hundred at most, for an
# attacker opening 20-odd a second).
CLIENT_TIMEOUT_S = 10.0
# A body may take a second for each 64 KiB on top of the timeout: 2 MB (the default payload limit) in 41 s, so a
# client on a 0.5 Mbit/s uplink still gets its largest prompt through; 10 KB/s is cut after ~12 s.
MIN_BODY_RATE = 64 * 1024
REQUEST_TIMEOUT = "request_timeout"


class BodyTimeout(ApiError, StarletteHTTPException):
    """A request body that did not arrive in time (408).

    Also an HTTPException: FastAPI re-raises those as they are while it reads the body (any other error there
    becomes a generic 400).
    """

    status = 408
    error_type = REQUEST_TIMEOUT

    def __init__(self, received: int, seconds: float) -> None:
        StarletteHTTPException.__init__(
            self, 408, f"Request body timed out: {received} bytes arrived in {seconds:.1f} s, too slowly"
        )

    @property
    def message(self) -> str:
        return str(self.detail)


class BodyDeadline:
    """ASGI layer: the body must arrive within `timeout` seconds plus one per `MIN_BODY_RATE` bytes received,
    counting only the time the route waits on it; then `BodyTimeout`, answered with `Connection: close`."""

    def __init__(self, app: ASGIApp, timeout: float = CLIENT_TIMEOUT_S) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        waited, received, complete, late = 0.0, 0, False, False

        async def timed_receive() -> Message:
            nonlocal waited, received, complete, late
            if complete:  # later calls wait for the client to leave, as long as the answer takes
                return await receive()
            allowance = self.timeout + received / MIN_BODY_RATE - waited
            started = loop.time()
            try:
                async with asyncio.timeout(max(allowance, 0.0)):
                    message = await receive()
            except TimeoutError:
                late = True
                raise BodyTimeout(received, waited + loop.time() - started) from None
            finally:
                waited += loop.time() - started
            received += len(message.get("body", b""))
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def closing_send(message: Message) -> None:
            # The rest of the body may still be on its way: the connection cannot carry another request.
            if late and message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, timed_receive, closing_send)


class SlowClientProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with deadlines on the request headers and on a body left unread after the
    answer (the body the route reads has `BodyDeadline`)."""

    client_timeout = CLIENT_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._in_headers = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self._headers_late)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        if self._deadline is None:  # a kept-alive connection's next request: its own time for its headers
            self._arm(self._headers_late)

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._disarm()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()  # the leftover of a body answered early is in
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        cycle = self.cycle
        if cycle is not None and cycle.response_complete and cycle.more_body and not self.transport.is_closing():
            self._arm(self._leftover_late)

    def _arm(self, late: Callable[[], None]) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.client_timeout, self._fire, late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _fire(self, late: Callable[[], None]) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused or (self.cycle is not None and not self.cycle.response_complete):
            # The server holds the client up (a pipelined request waits, an answer is being written): the
            # client gets its time again once that is over.
            self._arm(late)
            return
        late()

    def _headers_late(self) -> None:
        if self._in_headers:  # part of a request came: it can still be answered
            message = f"Request headers timed out: not complete within {self.client_timeout:g} s"
            self._write_408(json.dumps(error_body(message, REQUEST_TIMEOUT), separators=(",", ":")).encode())
        self.transport.close()

    def _leftover_late(self) -> None:
        self.transport.close()

    def _write_408(self, body: bytes) -> None:
        head = [b"HTTP/1.1 408 Request Timeout\r\n"]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body)]
        head += [b"connection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)
