"""The shard's spans: one SERVER span per shard call, continuing the router's batch span.

The router's `prefill` / `decode` span context arrives as W3C `traceparent` gRPC metadata, so a request's
trace runs from the client through the router into every shard that computed it. Only used when tracing is
on (the servicer checks first).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc

from kettle import tracing


def _batch_size(request: object) -> int:
    """Requests in the call's batch(es), for the span's attributes (0 for calls without a batch)."""
    batch = getattr(request, "batch", None)
    if batch is not None and hasattr(batch, "size"):
        return batch.size
    return sum(b.size for b in getattr(request, "batches", ()))


@contextlib.contextmanager
def shard_span(context: grpc.aio.ServicerContext, method: str, request: object) -> Iterator[None]:
    """A span named after the engine method (`prefill`, `decode` ...), parented on the caller's context."""
    carrier = tracing.grpc_carrier(context.invocation_metadata())
    with tracing.server_span(f"shard.{method}", carrier, batch_size=_batch_size(request)):
        yield
