"""OpenTelemetry tracing shared by the router and the shards: setup, spans, and W3C trace context over gRPC.

Off unless `--otlp-endpoint` is given. Off means no SDK at all: the SDK and the exporter are imported only
by `setup_tracing`, and every hook on the request path checks the module flag first and returns a shared
no-op context manager, so an untraced server does no tracing work per request or per batch.

On, spans are exported over OTLP/gRPC in batches from a background thread (the SDK's BatchSpanProcessor), so
the event loop never waits on the collector. The trace context crosses the router → shard hop as the W3C
`traceparent` gRPC metadata entry, injected by a client interceptor and read back by the shard's servicer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

logger = logging.getLogger(__name__)

NO_SPAN: AbstractContextManager[None] = nullcontext()  # reusable: one for every untraced block
_state: dict[str, Any] = {"enabled": False, "provider": None}


def enabled() -> bool:
    """Whether spans are recorded and exported (checked by every hook before it does anything)."""
    return _state["enabled"]


def setup_tracing(endpoint: str | None, service_name: str) -> bool:
    """Exports this process's spans to the OTLP/gRPC collector at `endpoint` (e.g. `http://localhost:4317`).

    Returns whether tracing is on. Without an endpoint nothing is set up (and nothing is imported).
    """
    if not endpoint:
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # Plain `host:port` means a local collector without TLS, as most deployments run it.
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
    use_span_processor(BatchSpanProcessor(exporter), service_name)
    logger.info("Exporting traces to %s as service %r", endpoint, service_name)
    return True


def use_span_processor(processor: Any, service_name: str) -> None:
    """Turns tracing on with `processor` (tests pass an in-memory exporter's SimpleSpanProcessor)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(processor)
    _state.update(enabled=True, provider=provider)


def shutdown_tracing() -> None:
    """Flushes the spans still buffered (at exit); a no-op when tracing is off."""
    provider = _state["provider"]
    _state.update(enabled=False, provider=None)
    if provider is not None:
        provider.shutdown()


def tracer() -> trace.Tracer:
    """Kettle's tracer on this process's provider (only called when tracing is on)."""
    return _state["provider"].get_tracer("kettle")


def span(name: str, **attributes: Any) -> AbstractContextManager[Any]:
    """A child span of the current one for the duration of a `with` block; a shared no-op when tracing is off."""
    if not _state["enabled"]:
        return NO_SPAN
    return tracer().start_as_current_span(name, attributes=attributes)


def annotate(**attributes: Any) -> None:
    """Adds attributes to the current span (the HTTP request's, in a route); nothing when tracing is off."""
    if _state["enabled"]:
        trace.get_current_span().set_attributes(attributes)


@contextlib.contextmanager
def server_span(name: str, carrier: Mapping[str, str], **attributes: Any) -> Iterator[trace.Span]:
    """A SERVER span continuing the trace of a W3C `traceparent` in `carrier`, current for the block."""
    parent = propagate.extract(carrier)
    kind = trace.SpanKind.SERVER
    with tracer().start_as_current_span(name, context=parent, kind=kind, attributes=attributes) as current:
        yield current


def current_context() -> otel_context.Context:
    return otel_context.get_current()


# --- gRPC: the trace context across the router → shard hop -------------------------------------------------


class _InjectTraceContext(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds the current span's `traceparent` to every outgoing call's metadata."""

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        if carrier:
            metadata = grpc.aio.Metadata(*(client_call_details.metadata or ()), *carrier.items())
            client_call_details = client_call_details._replace(metadata=metadata)
        return await continuation(client_call_details, request)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for the router's shard channels: none when tracing is off (no per-call cost)."""
    return [_InjectTraceContext()] if _state["enabled"] else []


def grpc_carrier(metadata: Iterable[tuple[str, Any]] | None) -> dict[str, str]:
    """The text entries of received gRPC metadata, as a carrier `propagate.extract` reads."""
    return {key: value for key, value in metadata or () if isinstance(value, str)}
