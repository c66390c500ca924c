"""The HTTP API (TGI generate routes and info routes) over a fake Infer that yields scripted events."""

from __future__ import annotations

import asyncio
import copy
import json
import math
from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient

import kettle
from kettle.proto import generate_pb2
from kettle.router.app import create_app
from kettle.router.config import RouterConfig
from kettle.router.tokenizer import TokenizerPool
from kettle.router.types import (
    FinishReason,
    GeneratedText,
    GenerationError,
    PrefillEvent,
    Token,
    TokenEvent,
    ValidGenerateRequest,
)
from kettle.router.validation import Validation, ValidationLimits

LIMITS = ValidationLimits(3, 4, 5, max_input_tokens=32, max_total_tokens=64)  # best_of, stop, top_n
INFO = generate_pb2.InfoResponse(dtype="float32", device_type="cpu", block_size=16, max_position_embeddings=256)
PROMPT = "Hello world!"
TEXTS = ("The", " capital", " is")
PATHS = {"master_shard_uds_path": "/tmp/none", "tokenizer_name": "/tmp/none"}
TEMPERATURE_ERROR = "Input validation error: `temperature` must be strictly positive"

Script = Callable[[ValidGenerateRequest, int], list]


def scripted(texts=TEXTS, logprob: float = -0.5, fail_after: int | None = None) -> Script:
    """Events of one generation: prefill (when asked), one token per text, the last one carrying the end."""

    def script(request: ValidGenerateRequest, _call: int) -> list:
        events: list = []
        if request.decoder_input_details:
            events.append(PrefillEvent((Token(1, "Hello", math.nan, False), Token(2, " world", -1.5, False))))
        for i, text in enumerate(texts):
            if fail_after == i:
                return [*events, GenerationError("shard 0 died")]
            top = (Token(10 + i, text, logprob, False), Token(20, "x", -3.0, False)) if request.top_n_tokens else ()
            end = None
            if i == len(texts) - 1:
                end = GeneratedText("".join(texts), len(texts), FinishReason.LENGTH, request.parameters.seed)
            events.append(TokenEvent(Token(10 + i, text, logprob, False), top, end, queued_at=0.0, started_at=0.0))
        return events

    return script


class FakeInfer:
    """Yields the events of `script` one by one; counts the generations closed (finished or abandoned)."""

    def __init__(self, script: Script | None = None, healthy: bool = True, hold: asyncio.Event | None = None) -> None:
        self.script = script or scripted()
        self.healthy = healthy
        self.hold = hold
        self.requests: list[ValidGenerateRequest] = []
        self.closed = 0

    async def generate(self, request: ValidGenerateRequest):
        self.requests.append(request)
        try:
            for i, event in enumerate(self.script(request, len(self.requests) - 1)):
                await asyncio.sleep(0)
                if isinstance(event, Exception):
                    raise event
                if i == 1 and self.hold is not None:
                    await self.hold.wait()
                yield event
        finally:
            self.closed += 1

    async def health(self) -> bool:
        return self.healthy


@pytest.fixture(scope="module")
def validation(tiny_tokenizer):
    pool = TokenizerPool(lambda: copy.deepcopy(tiny_tokenizer), workers=1)
    yield Validation(LIMITS, pool)
    pool.close()


@pytest.fixture
def make_client(validation):
    def make(infer: FakeInfer | None = None, **settings) -> TestClient:
        config = RouterConfig(**PATHS, model_id="tiny", **settings)
        return TestClient(create_app(config, infer or FakeInfer(), validation, INFO, LIMITS))

    return make


def sse_events(text: str) -> list[dict]:
    frames = text.split("\n\n")
    assert frames[-1] == "", "every event ends with a blank line"
    assert all(frame.startswith("data: ") for frame in frames[:-1])
    return [json.loads(frame.removeprefix("data: ")) for frame in frames[:-1]]


def test_generate_minimal_answer_and_headers(make_client):
    response = make_client().post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
    assert response.status_code == 200
    assert response.json() == {"generated_text": "The capital is"}
    headers = response.headers
    assert headers["x-compute-type"] == "cpu" and headers["x-compute-characters"] == str(len(PROMPT))
    assert headers["x-generated-tokens"] == "3" and int(headers["x-prompt-tokens"]) > 0
    for name in ("x-compute-time", "x-total-time", "x-validation-time", "x-queue-time", "x-inference-time"):
        assert float(headers[name]) >= 0
    assert "x-time-per-token" in headers


def test_generate_details(make_client):
    body = {"inputs": PROMPT, "parameters": {"details": True}}
    details = make_client().post("/generate", json=body).json()["details"]
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 3
    assert details["seed"] is None  # greedy
    assert details["prefill"] == []
    assert details["tokens"][0] == {"id": 10, "text": "The", "logprob": -0.5, "special": False}
    assert "top_tokens" not in details and "best_of_sequences" not in details


def test_generate_prefill_top_tokens_seed_and_full_text(make_client):
    parameters = {"decoder_input_details": True, "top_n_tokens": 2, "do_sample": True, "seed": 7}
    parameters["return_full_text"] = True
    answer = make_client().post("/generate", json={"inputs": PROMPT, "parameters": parameters}).json()
    assert answer["generated_text"] == PROMPT + "The capital is"
    details = answer["details"]
    assert details["prefill"] == [
        {"id": 1, "text": "Hello", "logprob": None},
        {"id": 2, "text": " world", "logprob": -1.5},
    ]
    assert details["seed"] == 7
    assert [len(step) for step in details["top_tokens"]] == [2, 2, 2]


def test_generate_stream_framing(make_client):
    body = {"inputs": PROMPT, "parameters": {"details": True}}
    response = make_client().post("/generate_stream", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-accel-buffering"] == "no" and response.headers["x-compute-type"] == "cpu"
    assert response.headers["x-compute-characters"] == str(len(PROMPT))
    assert "[DONE]" not in response.text
    events = sse_events(response.text)
    assert [e["index"] for e in events] == [1, 2, 3]
    assert [e["token"]["text"] for e in events] == list(TEXTS)
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    assert "top_tokens" not in events[0]
    last = events[-1]
    assert last["generated_text"] == "The capital is"
    assert last["details"] == {"finish_reason": "length", "generated_tokens": 3, "seed": None, "input_length": 3}


def test_error_inside_a_stream_is_one_event(make_client):
    infer = FakeInfer(scripted(fail_after=1))
    response = make_client(infer).post("/generate_stream", json={"inputs": PROMPT})
    assert response.status_code == 200
    events = sse_events(response.text)
    assert events[0]["index"] == 1
    assert events[1:] == [{"error": "Request failed during generation: shard 0 died", "error_type": "generation"}]
    assert infer.closed == 1


def test_generation_error_without_streaming(make_client):
    response = make_client(FakeInfer(scripted(fail_after=0))).post("/generate", json={"inputs": PROMPT})
    assert response.status_code == 424
    assert response.json() == {"error": "Request failed during generation: shard 0 died", "error_type": "generation"}


def test_compat_route(make_client):
    client = make_client()
    response = client.post("/", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
    assert response.json() == [{"generated_text": PROMPT + "The capital is"}]  # full text by default here
    plain = client.post("/", json={"inputs": PROMPT, "parameters": {"return_full_text": False}})
    assert plain.json() == [{"generated_text": "The capital is"}]
    streamed = client.post("/", json={"inputs": PROMPT, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert sse_events(streamed.text)[-1]["generated_text"] == PROMPT + "The capital is"


def test_compat_keeps_the_sampling_quirk(make_client):
    infer = FakeInfer()
    make_client(infer).post("/", json={"inputs": PROMPT})
    assert infer.requests[0].parameters.do_sample  # no `parameters` object: sampling on


JSON, TEXT = {"content-type": "application/json"}, {"content-type": "text/plain"}
BAD_TYPE = "Input validation error: parameters.max_new_tokens: Input should be a valid integer"
UNKNOWN_PARAMETER = "Input validation error: parameters.max_tokens: not a field this server supports"


@pytest.mark.parametrize(
    ("send", "status", "expected"),
    [
        ({"json": {"inputs": PROMPT, "parameters": {"temperature": 0.0}}}, 422, TEMPERATURE_ERROR),
        ({"json": {"inputs": PROMPT, "parameters": {"max_new_tokens": "many"}}}, 422, BAD_TYPE),
        ({"json": {"parameters": {}}}, 422, "Input validation error: inputs: Field required"),
        # A misspelt parameter (OpenAI's name here) is named, not ignored: ignored, the answer runs to the limit.
        ({"json": {"inputs": PROMPT, "parameters": {"max_tokens": 5}}}, 422, UNKNOWN_PARAMETER),
        ({"content": b'{"inputs": ', "headers": JSON}, 400, "bad_request"),
        ({"content": b'{"inputs": "x"}'}, 415, "unsupported_media_type"),
        ({"content": b'{"inputs": "x"}', "headers": TEXT}, 415, "unsupported_media_type"),
        ({"json": {"inputs": "x" * 300}}, 413, "payload_too_large"),
    ],
)
def test_error_shapes(make_client, send, status, expected):
    """`expected` is the whole message for validation errors, else the error type."""
    response = make_client(payload_limit=200).post("/generate", **send)
    assert response.status_code == status
    body = response.json()
    assert set(body) == {"error", "error_type"}
    assert expected in (body["error"], body["error_type"])
    assert status != 422 or body["error_type"] == "validation"


def test_api_key_protects_generation_routes_only(make_client):
    client = make_client(api_key="secret")
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = client.post("/generate", json={"inputs": PROMPT}, headers=headers)
        assert response.status_code == 401 and response.json()["error_type"] == "unauthorized"
    assert client.post("/tokenize", json={"inputs": PROMPT}).status_code == 401
    authorized = client.post("/generate", json={"inputs": PROMPT}, headers={"Authorization": "Bearer secret"})
    assert authorized.status_code == 200
    assert client.get("/health").status_code == 200 and client.get("/info").status_code == 200


def test_overloaded_when_no_permit_is_free(make_client):
    client = make_client(max_concurrent_requests=1)
    permits = client.app.state.generation.permits
    permits.acquire()
    response = client.post("/generate", json={"inputs": PROMPT})
    assert response.status_code == 429
    assert response.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
    assert client.post("/generate_stream", json={"inputs": PROMPT}).status_code == 429
    permits.release()
    assert client.post("/generate", json={"inputs": PROMPT}).status_code == 200


def test_permits_come_back_after_every_outcome(make_client):
    client = make_client(FakeInfer(scripted(fail_after=1)), max_concurrent_requests=2)
    client.post("/generate", json={"inputs": PROMPT})
    client.post("/generate_stream", json={"inputs": PROMPT})
    client.post("/generate", json={"inputs": ""})
    assert client.app.state.generation.permits.available == 2


def test_client_leaving_mid_stream_cancels_the_generation(make_client):
    """A disconnect after the first event stops the stream, closes Infer.generate and frees the permit."""
    hold = asyncio.Event()  # never set: the second token never comes
    infer = FakeInfer(hold=hold)
    app = make_client(infer).app
    messages = [{"type": "http.request", "body": json.dumps({"inputs": PROMPT}).encode(), "more_body": False}]
    first_event = asyncio.Event()

    async def receive():
        if messages:
            return messages.pop()
        await first_event.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            first_event.set()

    headers = [(b"content-type", b"application/json")]
    scope = {"type": "http", "method": "POST", "path": "/generate_stream", "headers": headers, "query_string": b""}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    assert infer.closed == 1
    assert app.state.generation.permits.available == app.state.generation.permits.total


def test_best_of_returns_the_highest_mean_logprob(make_client):
    def script(request, call):
        texts = ("A",) if call == 0 else ("B", "b") if call == 1 else ("C",)
        return scripted(texts, logprob=[-2.0, -0.25, -1.0][call])(request, call)

    infer = FakeInfer(script)
    body = {"inputs": PROMPT, "parameters": {"best_of": 3, "do_sample": True, "details": True}}
    answer = make_client(infer).post("/generate", json=body).json()
    assert answer["generated_text"] == "Bb"
    others = answer["details"]["best_of_sequences"]
    assert [o["generated_text"] for o in others] == ["A", "C"]
    assert len({r.parameters.seed for r in infer.requests}) == 3  # each candidate has its own seed
    assert answer["details"]["seed"] == infer.requests[1].parameters.seed


def test_tokenize_byte_offsets(make_client, tiny_tokenizer):
    text = "Hello 你好 😀"
    tokens = make_client().post("/tokenize", json={"inputs": text, "parameters": {"truncate": 1}}).json()
    assert [t["id"] for t in tokens] == tiny_tokenizer(text)["input_ids"]  # truncate ignored
    raw = text.encode()
    for token in tokens:
        assert set(token) == {"id", "text", "start", "stop"}
        assert token["text"] == raw[token["start"] : token["stop"]].decode()
    assert tokens[-1]["stop"] == len(raw)  # bytes, not characters
    assert "".join(t["text"] for t in tokens) == text


def test_info(make_client):
    info = make_client().get("/info").json()
    expected = {
        "model_id": "tiny",
        "model_dtype": "float32",
        "model_device_type": "cpu",
        "max_concurrent_requests": 128,
        "max_best_of": 3,
        "max_stop_sequences": 4,
        "max_input_tokens": 32,
        "max_total_tokens": 64,
        "validation_workers": 2,
        "max_client_batch_size": 4,
        "router": "text-generation-router",  # TGI's value, which clients check
        "version": kettle.__version__,
    }
    assert info.items() >= expected.items()
    assert {"model_sha", "model_pipeline_tag", "sha", "docker_label"} <= set(info)


def test_health(make_client):
    client = make_client()
    for path in ("/health", "/", "/ping"):
        assert client.get(path).status_code == 200
    sick = make_client(FakeInfer(healthy=False)).get("/health")
    assert sick.status_code == 503
    assert sick.json() == {"error": "unhealthy", "error_type": "healthcheck"}


def test_metrics(make_client):
    client = make_client()
    client.post("/generate", json={"inputs": PROMPT})
    client.post("/generate", json={"inputs": ""})
    text = client.get("/metrics").text
    assert "tgi_request_count" in text and "tgi_request_success" in text
    failures = [line for line in text.splitlines() if line.startswith("tgi_request_failure")]
    assert any('err="validation"' in line for line in failures)
    assert "tgi_request_generated_tokens_bucket" in text


def test_openapi_and_docs(make_client):
    client = make_client()
    paths = client.get("/api-doc/openapi.json").json()["paths"]
    for path in ("/generate", "/generate_stream", "/", "/tokenize", "/health", "/info", "/metrics"):
        assert path in paths
    assert {"get", "post"} <= set(paths["/"])
    assert client.get("/docs").status_code == 200


def test_cors(make_client):
    client = make_client(cors_allow_origin=("https://example.com",))
    response = client.get("/info", headers={"Origin": "https://example.com"})
    assert response.headers["access-control-allow-origin"] == "https://example.com"
