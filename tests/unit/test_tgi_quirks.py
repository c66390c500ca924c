"""TGI behaviours clients can observe, kept as TGI has them: validation inside streams, `adapter_id` checks and
JSON-schema grammars without `properties` (the router app with a fake Infer; the completions error types are in
test_openai_api.py, `/info.router` in test_http_api.py)."""

from __future__ import annotations

import copy

import pytest
from fastapi.testclient import TestClient

from kettle.router.adapters import check_adapter
from kettle.router.app import create_app
from kettle.router.config import RouterConfig
from kettle.router.errors import ValidationError
from kettle.router.schemas import GenerateParameters
from kettle.router.tokenizer import TokenizerPool
from kettle.router.validation import Validation
from tests.unit.test_http_api import INFO, LIMITS, PATHS, PROMPT, TEMPERATURE_ERROR, FakeInfer, sse_events

NO_PROPERTIES = "Input validation error: grammar is not valid: Grammar must have a 'properties' field"
NOT_LOADED = "Input validation error: adapter `org/lora` is not loaded (loaded adapters: none)"


@pytest.fixture(scope="module")
def client(tiny_tokenizer):
    pool = TokenizerPool(lambda: copy.deepcopy(tiny_tokenizer), workers=1)
    config = RouterConfig(**PATHS, model_id="tiny")
    yield TestClient(create_app(config, FakeInfer(), Validation(LIMITS, pool), INFO, LIMITS))
    pool.close()


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/generate_stream", {"inputs": PROMPT, "parameters": {"temperature": 0.0}}, TEMPERATURE_ERROR),
        ("/", {"inputs": PROMPT, "parameters": {"temperature": 0.0}, "stream": True}, TEMPERATURE_ERROR),
        (
            "/generate_stream",
            {"inputs": PROMPT, "parameters": {"best_of": 2, "do_sample": True}},
            "Input validation error: `best_of` != 1 is not supported when streaming tokens",
        ),
        ("/generate_stream", {"inputs": PROMPT, "parameters": {"adapter_id": "org/lora"}}, NOT_LOADED),
    ],
)
def test_a_stream_that_fails_validation_is_200_with_one_error_event(client, path, body, message):
    response = client.post(path, json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert sse_events(response.text) == [{"error": message, "error_type": "validation"}]
    assert client.app.state.generation.permits.available == client.app.state.generation.permits.total


def test_schema_errors_on_streams_stay_422(client):
    """A body that does not parse never reaches the stream (TGI's JSON extractor refuses it first)."""
    response = client.post("/generate_stream", json={"inputs": PROMPT, "parameters": {"max_new_tokens": "many"}})
    assert response.status_code == 422 and response.json()["error_type"] == "validation"


def test_unknown_adapter_is_422_naming_the_loaded_ones(client):
    response = client.post("/generate", json={"inputs": PROMPT, "parameters": {"adapter_id": "org/lora"}})
    assert response.status_code == 422
    assert response.json() == {"error": NOT_LOADED, "error_type": "validation"}
    assert client.post("/generate", json={"inputs": PROMPT, "parameters": {"adapter_id": None}}).status_code == 200


def test_a_loaded_adapter_passes_and_the_message_lists_them():
    check_adapter(GenerateParameters(adapter_id="org/a"), ("org/a", "org/b"))
    check_adapter(None, ())
    with pytest.raises(ValidationError, match=r"adapter `x` is not loaded \(loaded adapters: `org/a`, `org/b`\)"):
        check_adapter(GenerateParameters(adapter_id="x"), ("org/a", "org/b"))


@pytest.mark.parametrize(
    "grammar",
    [
        {"type": "json", "value": {"type": "object"}},
        {"type": "json", "value": {"type": "array", "items": {"type": "integer"}}},
        {"type": "json_schema", "value": {"name": "x", "schema": {"type": "string"}}},
    ],
)
def test_a_json_schema_without_properties_is_refused(client, grammar):
    response = client.post("/generate", json={"inputs": PROMPT, "parameters": {"grammar": grammar}})
    assert response.status_code == 422
    assert response.json() == {"error": NO_PROPERTIES, "error_type": "validation"}


def test_a_json_schema_with_properties_is_accepted(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}}}
    response = client.post(
        "/generate", json={"inputs": PROMPT, "parameters": {"grammar": {"type": "json", "value": schema}}}
    )
    assert response.status_code == 200
