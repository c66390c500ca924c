"""Property-based API testing with schemathesis against the server's own OpenAPI document.

For each generate, tokenize and chat route, schemathesis builds requests from `/api-doc/openapi.json`
(valid ones and deliberately broken ones) and sends them to the real server. The server must never answer 5xx,
and every 4xx must be TGI's JSON error `{"error": str, "error_type": str}`. Token counts the examples ask
for are capped, so the run stays short on the tiny model (what is tested is the HTTP contract, not length).
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

# Examples per route: mostly valid requests, some deliberately broken ones (they must get a 4xx, never a 5xx).
EXAMPLES = {GenerationMode.POSITIVE: 20, GenerationMode.NEGATIVE: 10}
ROUTES = ("/generate", "/generate_stream", "/tokenize", "/chat_tokenize", "/v1/chat/completions")
# Generation lengths a random example may ask for, capped to keep each request a few decode steps.
LENGTH_FIELDS = ("max_new_tokens", "max_tokens", "max_completion_tokens")
LENGTH_CAP = 4


@pytest.fixture(scope="module")
def api_schema(tiny_server):
    return schemathesis.openapi.from_url(f"{tiny_server.url}/api-doc/openapi.json")


def _cap_lengths(body: object) -> None:
    """Caps generation lengths in a JSON body (top level and under `parameters`), in place."""
    if not isinstance(body, dict):
        return
    for holder in (body, body.get("parameters")):
        if not isinstance(holder, dict):
            continue
        for name in LENGTH_FIELDS:
            value = holder.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > LENGTH_CAP:
                holder[name] = LENGTH_CAP


def _check(case) -> None:
    _cap_lengths(case.body)
    response = case.call(timeout=60)
    assert response.status_code < 500, (response.status_code, response.text[:500], case.body)
    if 400 <= response.status_code < 500:
        body = response.json()
        assert isinstance(body, dict) and set(body) == {"error", "error_type"}, body
        assert isinstance(body["error"], str) and isinstance(body["error_type"], str), body


@pytest.mark.parametrize("mode", list(EXAMPLES))
@pytest.mark.parametrize("path", ROUTES)
def test_no_server_errors_and_tgi_error_shape(api_schema, path, mode):
    strategy = api_schema[path]["POST"].as_strategy(generation_mode=mode)
    limits = settings(
        max_examples=EXAMPLES[mode],
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    limits(given(case=strategy)(_check))()
