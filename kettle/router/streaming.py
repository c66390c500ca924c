"""Server-sent events: `data: <json>\\n\\n` framing over a plain StreamingResponse (docs/api.md, Responses and streams).

Plain framing instead of sse-starlette: the TGI and OpenAI streams use only `data:` lines (no event names, ids or
keep-alive comments), which is three lines of code and one dependency less. Route modules produce payloads
(pydantic models or dicts); this module frames them, turns a failure after the start into one error event, and
runs a cleanup callback however the stream ends: finished, failed, or cancelled by a client that went away.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing
from typing import Any

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kettle.router.errors import describe

SSE_MEDIA_TYPE = "text/event-stream"
DONE_EVENT = b"data: [DONE]\n\n"

ErrorEvent = Callable[[BaseException], Any]


def sse_event(payload: BaseModel | Mapping[str, Any]) -> bytes:
    """One event: `data: <compact json>` and a blank line."""
    data = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + text.encode("utf-8") + b"\n\n"


def tgi_error_event(exc: BaseException) -> dict[str, str]:
    """TGI's in-stream error: the same `{"error", "error_type"}` body as a JSON error answer."""
    return describe(exc)[1]


async def sse_body(
    payloads: AsyncIterator[BaseModel | Mapping[str, Any]],
    error_event: ErrorEvent = tgi_error_event,
    *,
    done_marker: bool = False,
) -> AsyncIterator[bytes]:
    """Frames `payloads`; an exception ends the stream with one error event. `done_marker` appends `[DONE]`
    to every stream that was not cancelled, failed ones included (the OpenAI routes; TGI's have none)."""
    async with aclosing(payloads):
        try:
            async for payload in payloads:
                yield sse_event(payload)
        except Exception as exc:
            # The status line (200) is already sent: the error can only travel as an event.
            yield sse_event(error_event(exc))
    if done_marker:
        yield DONE_EVENT


async def failed_stream(exc: BaseException) -> AsyncIterator[Any]:
    """A stream whose only content is `exc`: `sse_body` turns it into the one error event."""
    raise exc
    yield  # unreachable; makes this an async generator


class SSEResponse(StreamingResponse):
    """A `text/event-stream` response that calls `on_close` once when it ends, whatever the reason.

    The callback lives here rather than in the body generator: a generator that never started (the client
    left before the first byte) never runs its `finally`, and a leaked concurrency permit would be lost for good.
    """

    media_type = SSE_MEDIA_TYPE

    def __init__(
        self,
        body: AsyncIterator[bytes],
        headers: Mapping[str, str] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        merged = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        super().__init__(body, headers=merged)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close_body()
            if self._on_close is not None:
                self._on_close()

    async def _close_body(self) -> None:
        # Starlette cancels the body task on disconnect; closing it here makes sure the generation is dropped.
        close = getattr(self.body_iterator, "aclose", None)
        if close is not None:
            await close()
