"""Operating Kettle: metrics on --prometheus-port, traces over OTLP, JSON logs, limits, faults and SIGTERM.

One real server (launcher → shard → router on the tiny model) for the module, exporting its traces to a small
OTLP receiver in this process. The last test stops it with SIGTERM in the middle of 8 streams.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from kettle.bench.process import KettleServer, free_port
from tests.e2e.otlp_receiver import OtlpReceiver
from tests.faults import fault_env, fault_prompt

MAX_TOTAL_TOKENS = 512
TGI_METRICS = {
    "counter": [
        "tgi_request_count",
        "tgi_request_success",
        "tgi_request_failure",
        "tgi_batch_inference_count",
        "tgi_batch_inference_success",
        "tgi_batch_inference_failure",
    ],
    "gauge": ["tgi_queue_size", "tgi_batch_current_size", "tgi_batch_current_max_tokens"],
    "histogram": [
        "tgi_request_duration",
        "tgi_request_validation_duration",
        "tgi_request_queue_duration",
        "tgi_request_inference_duration",
        "tgi_request_mean_time_per_token_duration",
        "tgi_request_input_length",
        "tgi_request_generated_tokens",
        "tgi_batch_forward_duration",
        "tgi_batch_next_size",
    ],
}
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def receiver():
    receiver = OtlpReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def prod(tiny_llama_path, receiver):
    prometheus_port = free_port()
    server = KettleServer(
        str(tiny_llama_path),
        *("--max-input-tokens", "64", "--max-total-tokens", str(MAX_TOTAL_TOKENS)),
        *("--max-concurrent-requests", "16", "--graceful-termination-timeout", "60", "--json-output"),
        *("--otlp-endpoint", receiver.endpoint, "--prometheus-port", str(prometheus_port)),
        # Export spans every 200 ms instead of 5 s, so the trace test does not wait.
        env={**fault_env(), "OTEL_BSP_SCHEDULE_DELAY": "200", "LOG_LEVEL": "INFO"},
    )
    server.prometheus_url = f"http://127.0.0.1:{prometheus_port}/metrics"
    yield server
    server.stop()


def generate(server: KettleServer, inputs: str, max_new_tokens: int = 4, **headers: str) -> httpx.Response:
    body = {"inputs": inputs, "parameters": {"max_new_tokens": max_new_tokens}}
    return httpx.post(f"{server.url}/generate", json=body, headers=headers, timeout=60)


def test_prometheus_port_serves_every_spec_metric_with_tgi_names(prod):
    assert generate(prod, "Hello").status_code == 200
    assert generate(prod, "").status_code == 422
    text = httpx.get(prod.prometheus_url, timeout=10).text
    for kind, names in TGI_METRICS.items():
        for name in names:
            assert f"# TYPE {name} {kind}" in text, name
    assert not re.search(r"^tgi_\w+_total", text, re.MULTILINE), "TGI's counters have no _total suffix"
    assert 'tgi_request_failure{err="validation"} 1.0' in text
    assert re.search(r'tgi_batch_forward_duration_bucket\{le="[0-9.]+",method="prefill"\}', text)
    assert re.search(r"^kettle_kv_blocks_total [1-9]", text, re.MULTILINE)
    api_names = set(re.findall(r"^# TYPE (\w+)", httpx.get(f"{prod.url}/metrics").text, re.MULTILINE))
    assert api_names == set(re.findall(r"^# TYPE (\w+)", text, re.MULTILINE))


def test_every_process_logs_its_resident_memory_once_and_exposes_it_as_a_gauge(prod):
    prod.wait_for_log("Resident memory of shard-0")  # logged once its KV cache is resident, just after it is ready
    text = httpx.get(prod.prometheus_url, timeout=10).text
    gauges = re.findall(r'^kettle_process_resident_memory_bytes\{process="([\w-]+)"\} (\S+)$', text, re.MULTILINE)
    values = {process: float(value) for process, value in gauges}
    assert set(values) == {"launcher", "router", "shard-0"}, text
    # Plausible: more than 16 MiB each (any Python process with its imports), less than the machine has.
    assert all(16 * 2**20 < value < psutil.virtual_memory().total for value in values.values()), values
    assert values["shard-0"] > values["launcher"], values  # the shard holds torch and the model; the launcher neither
    records = [json.loads(line) for line in Path(prod.log.name).read_text().splitlines() if line.strip()]
    logged = [r["fields"] for r in records if "resident_memory_bytes" in r.get("fields", {})]
    assert sorted(fields["process"] for fields in logged) == ["launcher", "router", "shard-0"]
    assert all(fields["resident_memory_bytes"] > 16 * 2**20 for fields in logged)
    # The CPU shard tells its KV cache apart from the rest: the cache is resident, so inside the total.
    shard = next(fields for fields in logged if fields["process"] == "shard-0")
    assert 0 < shard["kv_cache_bytes"] < shard["resident_memory_bytes"], shard


def test_one_trace_across_router_and_shard_parented_on_the_client(prod, receiver):
    traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    assert generate(prod, "Hello", max_new_tokens=3, traceparent=traceparent).status_code == 200
    names = {"POST /generate", "validation", "queue", "infer", "prefill", "decode", "shard.prefill", "shard.decode"}
    spans = receiver.wait_for(CLIENT_TRACE_ID, names)
    assert names <= {s.name for s in spans}
    by_name = {s.name: s for s in spans}
    root = by_name["POST /generate"]
    assert (root.service, root.parent_span_id) == ("kettle", CLIENT_SPAN_ID)
    for child in ("validation", "queue", "infer"):
        assert by_name[child].parent_span_id == root.span_id, child
    assert by_name["prefill"].parent_span_id == by_name["infer"].span_id
    router_batches = {s.span_id for s in spans if s.name in ("prefill", "decode")}
    shard_spans = [s for s in spans if s.name.startswith("shard.")]
    assert all(s.service == "kettle.shard" and s.parent_span_id in router_batches for s in shard_spans)
    shard_prefill = by_name["shard.prefill"]
    assert shard_prefill.parent_span_id == by_name["prefill"].span_id


def test_limits_are_enforced_before_scheduling(prod):
    completions = {"model": "tgi", "prompt": ["a", "b", "c", "d", "e"], "max_tokens": 2}
    too_many = httpx.post(f"{prod.url}/v1/completions", json=completions, timeout=30)
    assert too_many.status_code == 422 and too_many.json()["error_type"] == "batch size exceeded"  # TGI's type
    too_long = generate(prod, "Hello", max_new_tokens=MAX_TOTAL_TOKENS)
    assert too_long.status_code == 422
    assert "must be <= 512" in too_long.json()["error"]
    assert httpx.get(f"{prod.url}/health").status_code == 200


def test_a_failed_stream_fails_alone_and_the_server_keeps_serving(prod):
    body = {"inputs": fault_prompt("prefill", "Hi"), "parameters": {"max_new_tokens": 4}}
    with httpx.stream("POST", f"{prod.url}/generate_stream", json=body, timeout=60) as response:
        events = [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]
    assert events[-1]["error_type"] == "generation"
    assert generate(prod, "Hello").status_code == 200
    assert httpx.get(f"{prod.url}/health").status_code == 200


def test_every_log_line_is_json_with_one_line_per_request(prod):
    assert generate(prod, "Hello", max_new_tokens=5, **{"x-request-id": "req-abc"}).headers["x-request-id"] == "req-abc"
    deadline = time.monotonic() + 10
    while '"req-abc"' not in Path(prod.log.name).read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    records = [json.loads(line) for line in Path(prod.log.name).read_text().splitlines() if line.strip()]
    targets = {r["target"].split(".")[1] for r in records if r["target"].startswith("kettle.")}
    assert {"launcher", "router", "shard"} <= targets
    assert any(r["message"].startswith("Serving ") for r in records)
    done = next(r for r in records if r.get("fields", {}).get("id") == "req-abc")
    fields = done["fields"]
    assert (fields["generated_tokens"], fields["finish_reason"]) == (5, "length")
    assert {"input_tokens", "total_time_ms", "queue_time_ms", "inference_time_ms"} <= set(fields)


async def _stream(url: str, first_token: asyncio.Event) -> dict:
    """One long stream; returns its last event."""
    body = {"inputs": "Once upon", "parameters": {"max_new_tokens": 400, "details": True}}
    last: dict = {}
    async with (
        httpx.AsyncClient(timeout=120) as client,
        client.stream("POST", f"{url}/generate_stream", json=body) as response,
    ):
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                last = json.loads(line[5:])
                first_token.set()
    return last


async def _status(method: str, url: str, **kwargs) -> int | str:
    """The status code, or the name of the transport error (connection refused after the server closed)."""
    async with httpx.AsyncClient(timeout=10) as client:
        try:
            response = await client.request(method, url, **kwargs)
        except httpx.TransportError as error:
            return type(error).__name__
    if response.status_code == 503:
        assert set(response.json()) == {"error", "error_type"}
    return response.status_code


async def _drain_scenario(prod: KettleServer) -> tuple[list[dict], int | str, int | str]:
    started = [asyncio.Event() for _ in range(8)]
    streams = [asyncio.ensure_future(_stream(prod.url, event)) for event in started]
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
    prod.process.send_signal(signal.SIGTERM)
    # The launcher forwards it to the router, which starts draining: probed as soon as that shows, not after a fixed
    # pause (on the tiny model, with several decode steps per call, 400 tokens take well under a second).
    health = await _status("GET", f"{prod.url}/health")
    for _ in range(100):
        if health != 200:
            break
        await asyncio.sleep(0.02)
        health = await _status("GET", f"{prod.url}/health")
    refused = await _status("POST", f"{prod.url}/generate", json={"inputs": "late"})
    return list(await asyncio.gather(*streams)), health, refused


def test_sigterm_lets_running_streams_finish_and_refuses_new_requests(prod):
    finals, health, refused = asyncio.run(_drain_scenario(prod))
    for final in finals:
        assert final.get("generated_text") is not None, final
        assert final["details"]["generated_tokens"] >= 1
    # Draining keeps the port open: probes and late clients get a clear 503, not a refused connection.
    assert (health, refused) == (503, 503)
    # The 8 streams, and the first health probe when it reached the router before the signal did.
    assert re.search(r"Draining: [1-9] request\(s\) in flight", Path(prod.log.name).read_text())
    assert prod.process.wait(90) == 0, prod.logs()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{prod.url}/health", timeout=2)
