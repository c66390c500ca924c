"""Tracing with the OpenTelemetry SDK's in-memory exporter: span tree, W3C parents, and no work when off."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kettle import tracing
from kettle.router.config import SchedulerConfig
from kettle.router.infer import Infer
from kettle.router.tracing import TracingMiddleware, batch_span
from kettle.router.types import TokenEvent
from kettle.shard.tracing import shard_span
from tests.unit.fake_client import FakeClient, make_request

CONFIG = SchedulerConfig(max_batch_prefill_tokens=64, max_batch_total_tokens=256, block_size=4, num_blocks=64)
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


@pytest.fixture
def exporter():
    exporter = InMemorySpanExporter()
    tracing.use_span_processor(SimpleSpanProcessor(exporter), "kettle-test")
    yield exporter
    tracing.shutdown_tracing()


def by_name(exporter: InMemorySpanExporter) -> dict[str, list]:
    spans: dict[str, list] = {}
    for span in exporter.get_finished_spans():
        spans.setdefault(span.name, []).append(span)
    return spans


def test_off_means_shared_no_ops():
    assert not tracing.enabled()
    assert tracing.span("validation") is tracing.span("queue")
    assert batch_span("decode", [1, 2]) is tracing.span("x")
    assert tracing.client_interceptors() == []


def test_http_span_continues_the_client_trace(exporter):
    app = FastAPI()

    @app.get("/work")
    async def work() -> dict:
        with tracing.span("validation"):
            return {}

    app.add_middleware(TracingMiddleware)
    assert TestClient(app).get("/work", headers={"traceparent": TRACEPARENT}).status_code == 200
    spans = by_name(exporter)
    root, child = spans["GET /work"][0], spans["validation"][0]
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert format(root.parent.span_id, "016x") == CLIENT_SPAN
    assert child.parent.span_id == root.context.span_id
    assert root.attributes["http.status_code"] == 200


async def _two_requests_in_one_batch() -> None:
    infer = Infer(FakeClient(), CONFIG)
    infer.start()

    async def one(max_new: int) -> None:
        with tracing.span("request"):
            async for event in infer.generate(make_request(max_new=max_new)):
                assert isinstance(event, TokenEvent)

    await asyncio.gather(one(3), one(2))
    await infer.stop()


def test_queue_infer_and_batch_spans_per_request(exporter):
    asyncio.run(_two_requests_in_one_batch())
    spans = by_name(exporter)
    requests = {s.context.span_id: s for s in spans["request"]}
    assert len(spans["queue"]) == len(spans["infer"]) == 2
    for name in ("queue", "infer"):
        assert {s.parent.span_id for s in spans[name]} == set(requests)
    infer_ids = {s.context.span_id for s in spans["infer"]}
    (prefill,) = spans["prefill"]
    assert prefill.parent.span_id in infer_ids  # led by one request ...
    assert {link.context.span_id for link in prefill.links} == infer_ids - {prefill.parent.span_id}  # ... linked
    assert spans["decode"] and all(s.parent.span_id in infer_ids for s in spans["decode"])
    assert len({s.context.trace_id for s in exporter.get_finished_spans()}) == 2  # one trace per request


class _ServicerContext:
    def __init__(self, metadata: list[tuple[str, str]]) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.metadata


def test_the_trace_context_crosses_the_grpc_hop(exporter):
    captured = {}

    async def continuation(details, request):
        captured["metadata"] = list(details.metadata)

    async def call() -> None:
        with tracing.span("decode"):
            details = grpc.aio.ClientCallDetails("/x/Decode", None, None, None, None)
            await tracing.client_interceptors()[0].intercept_unary_unary(continuation, details, None)

    asyncio.run(call())
    assert [key for key, _ in captured["metadata"]] == ["traceparent"]
    with shard_span(_ServicerContext(captured["metadata"]), "decode", object()):
        pass
    spans = by_name(exporter)
    router, shard = spans["decode"][0], spans["shard.decode"][0]
    assert shard.parent.span_id == router.context.span_id
    assert shard.context.trace_id == router.context.trace_id
