"""The router's spans: one trace per HTTP request, with validation, queue, infer and the batches it ran in.

```
POST /generate            SERVER span, parented on the client's `traceparent` header (TracingMiddleware)
├── validation            GenerationService.admit
├── queue                 from the append to the first batch that holds the request
└── infer                 from that batch to the request's end
    ├── prefill           a shard call, when this request leads the batch (its oldest request); other
    └── decode …          requests of the batch are linked. The shard's own spans continue these (gRPC
                          metadata carries the trace context).
```

Every function here returns at once when tracing is off (see kettle/tracing.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kettle import tracing

# Span timestamps are wall-clock nanoseconds; the router measures with time.monotonic().
_WALL_OFFSET_NS = time.time_ns() - time.monotonic_ns()


@dataclass
class RequestSpans:
    """The spans of one queued request, created lazily as it moves from the queue into batches."""

    parent: Context
    queued_ns: int = field(default_factory=time.monotonic_ns)
    infer: trace.Span | None = None

    def infer_span(self) -> trace.Span:
        """The `infer` span, started (and the `queue` span recorded) the first time a batch holds the request."""
        if self.infer is None:
            now = time.time_ns()
            queue = tracing.tracer().start_span(
                "queue", context=self.parent, start_time=self.queued_ns + _WALL_OFFSET_NS
            )
            queue.end(end_time=now)
            self.infer = tracing.tracer().start_span("infer", context=self.parent, start_time=now)
        return self.infer


_requests: dict[int, RequestSpans] = {}


def request_queued(request_id: int) -> None:
    """Remembers the current trace context (the HTTP request's) for a request entering the queue."""
    if tracing.enabled():
        _requests[request_id] = RequestSpans(tracing.current_context())


def request_ended(request_id: int, error: BaseException | None = None) -> None:
    """Ends the request's spans; a request that never left the queue still gets its `queue` span."""
    spans = _requests.pop(request_id, None)
    if spans is None:
        return
    infer = spans.infer_span()
    if error is not None:
        infer.set_status(trace.StatusCode.ERROR, str(error) or type(error).__name__)
    infer.end()


def batch_span(method: str, request_ids: Sequence[int]) -> AbstractContextManager[None]:
    """A `prefill` / `decode` span around one shard call, current while the call (and its gRPC hop) runs."""
    if not tracing.enabled():
        return tracing.NO_SPAN
    return _batch_span(method, request_ids)


@contextlib.contextmanager
def _batch_span(method: str, request_ids: Sequence[int]) -> Iterator[None]:
    known = [_requests[i] for i in request_ids if i in _requests]
    if not known:
        yield
        return
    lead, others = known[0].infer_span(), [s.infer_span() for s in known[1:]]
    links = [trace.Link(s.get_span_context()) for s in others]
    parent = trace.set_span_in_context(lead)
    attributes = {"batch_size": len(request_ids)}
    with tracing.tracer().start_as_current_span(method, context=parent, links=links, attributes=attributes):
        yield


class TracingMiddleware:
    """Opens the request's SERVER span, continuing the client's W3C trace context when it sent one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not tracing.enabled():
            await self.app(scope, receive, send)
            return
        carrier = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope.get("headers", ())}
        name = f"{scope['method']} {scope['path']}"
        with tracing.server_span(name, carrier, **{"http.method": scope["method"], "http.target": scope["path"]}) as s:

            async def traced_send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    s.set_attribute("http.status_code", message["status"])
                    if message["status"] >= 500:
                        s.set_status(trace.StatusCode.ERROR)
                await send(message)

            await self.app(scope, receive, traced_send)
