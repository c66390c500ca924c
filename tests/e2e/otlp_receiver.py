"""A tiny OTLP/gRPC trace collector for tests: it keeps every span it receives, with its service name."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    """The parts of an exported span the tests look at (ids as hex, like `traceparent`)."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    links: tuple[str, ...]


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        received = []
        for resource_spans in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            service = attributes.get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                received += [_received(service, span) for span in scope_spans.spans]
        with self.lock:
            self.spans += received
        return trace_service_pb2.ExportTraceServiceResponse()


def _received(service: str, span) -> ReceivedSpan:
    links = tuple(link.span_id.hex() for link in span.links)
    return ReceivedSpan(service, span.name, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(), links)


class OtlpReceiver:
    """Listens on 127.0.0.1 (a free port); `endpoint` is what `--otlp-endpoint` takes."""

    def __init__(self) -> None:
        self._collector = _Collector()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self._collector, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{port}"
        self._server.start()

    def spans(self, trace_id: str) -> list[ReceivedSpan]:
        with self._collector.lock:
            return [s for s in self._collector.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout: float = 20) -> list[ReceivedSpan]:
        """The spans of `trace_id` once all `names` arrived (or whatever arrived by `timeout`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            spans = self.spans(trace_id)
            if names <= {s.name for s in spans}:
                return spans
            time.sleep(0.1)
        return self.spans(trace_id)

    def stop(self) -> None:
        self._server.stop(grace=None)
