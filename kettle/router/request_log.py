"""One log line per generation request when it ends: its id, token counts, times and finish reason (or error).

Like TGI's `Success` line. The id is the HTTP request's: the client's `x-request-id` header when it sent one
(so a proxy's id can be followed into Kettle's log), else a counter; it is echoed in the `x-request-id`
response header. The numbers also travel as structured `fields` in `--json-output` lines.
"""

from __future__ import annotations

import itertools
import logging
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("kettle.router.requests")

REQUEST_ID: ContextVar[str] = ContextVar("kettle_request_id", default="-")
_IDS = itertools.count(1)
_MAX_ID_LENGTH = 128  # a client-chosen id goes into every log line: keep it bounded


def success(
    input_tokens: int, generated_tokens: int, finish_reason: str, times: dict[str, float], adapter: str | None = None
) -> None:
    """Logs a finished generation; `times` are seconds (total, validation, queue, inference, per token);
    `adapter`: the LoRA adapter it ran with."""
    fields = {
        "id": REQUEST_ID.get(),
        **({"adapter": adapter} if adapter else {}),
        "input_tokens": input_tokens,
        "generated_tokens": generated_tokens,
        "finish_reason": finish_reason,
        **{f"{name}_time_ms": round(seconds * 1000, 3) for name, seconds in times.items()},
    }
    text = " ".join(f"{key}={value}" for key, value in fields.items() if key != "id")
    logger.info("request %s succeeded: %s", fields["id"], text, extra={"fields": fields})


def failure(error_type: str, message: str) -> None:
    """Logs a request that ended with an error (validation, overload, shard failure ...)."""
    fields = {"id": REQUEST_ID.get(), "error_type": error_type, "error": message}
    logger.info("request %s failed: %s: %s", fields["id"], error_type, message, extra={"fields": fields})


class RequestIdMiddleware:
    """Gives each HTTP request its id (for the log line above) and echoes it in `x-request-id`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), b"")
        request_id = given.decode("latin-1")[:_MAX_ID_LENGTH] or str(next(_IDS))
        token = REQUEST_ID.set(request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)
