"""A seeded property-based fuzz over every generation route and parameter, against the real server.

Each example takes a valid body for a route and puts values at the edges into some of its fields (int64 and
uint64 bounds, ±inf, NaN, lone surrogates, control characters, huge strings, deep nesting, wrong types, unknown
names). Whatever is sent: no 5xx, an answer within the bound, and afterwards every KV block free, the ledger
balanced and the server healthy.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from tests.e2e.kv_pool import assert_pool_whole

ANSWER_WITHIN = 60
# About a minute in `make test`; FUZZ_EXAMPLES=1000 for a longer run by hand.
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
USER = [{"role": "user", "content": "Hi"}]
GENERATE_PARAMETERS = [
    "best_of", "decoder_input_details", "details", "do_sample", "frequency_penalty", "grammar", "max_new_tokens",
    "presence_penalty", "repetition_penalty", "return_full_text", "seed", "stop", "temperature", "top_k",
    "top_n_tokens", "top_p", "truncate", "typical_p", "watermark", "adapter_id", "not_a_parameter",
]  # fmt: skip
OPENAI_FIELDS = [
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "n", "frequency_penalty",
    "presence_penalty", "logprobs", "top_logprobs", "tools", "tool_choice", "response_format", "stream",
    "logit_bias", "model", "stream_options", "messages", "prompt", "suffix", "echo", "repetition_penalty",
]  # fmt: skip
# route -> (a valid body, the fields fuzzed, where they live: "parameters" or the top level)
ROUTES = {
    "/generate": ({"inputs": "Hello", "parameters": {"max_new_tokens": 4}}, GENERATE_PARAMETERS, "parameters"),
    "/generate_stream": ({"inputs": "Hello", "parameters": {"max_new_tokens": 4}}, GENERATE_PARAMETERS, "parameters"),
    "/": ({"inputs": "Hello", "parameters": {"max_new_tokens": 4}}, [*GENERATE_PARAMETERS, "stream"], "parameters"),
    "/tokenize": ({"inputs": "Hello"}, ["inputs", "parameters"], ""),
    "/v1/chat/completions": ({"messages": USER, "max_tokens": 4}, OPENAI_FIELDS, ""),
    "/v1/completions": ({"prompt": "Hello", "max_tokens": 4}, OPENAI_FIELDS, ""),
    "/chat_tokenize": ({"messages": USER}, ["messages", "tools", "tool_choice"], ""),
    "/invocations": (
        {"inputs": "Hello", "parameters": {"max_new_tokens": 4}},
        ["inputs", "parameters", "messages"],
        "",
    ),
}

edge_ints = st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, -(2**63), 2**64, 10**30])
edge_floats = st.sampled_from([0.0, -0.0, 1e-45, 1e-38, 1e38, 3.5e38, 1e308, float("inf"), -float("inf"), float("nan")])
edge_texts = st.one_of(
    st.sampled_from(["", "\ud800", "\udc00x", "a\x00b", "\x1b[2J", "\u202e", "😀" * 3, "{", "null", "a" * 100_000]),
    st.text(max_size=20),
)
scalars = st.one_of(st.none(), st.booleans(), edge_ints, edge_floats, edge_texts)
deep = st.integers(1, 3000).map(lambda depth: json.loads("[" * depth + "]" * depth) if depth < 900 else "deep")
values = st.recursive(
    scalars | deep,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(edge_texts, inner, max_size=3),
    max_leaves=6,
)


@st.composite
def requests(draw) -> tuple[str, str]:
    """A route and a raw JSON body (NaN and Infinity spelled as Python's json writes them)."""
    route = draw(st.sampled_from(sorted(ROUTES)))
    body, fields, where = ROUTES[route]
    body = json.loads(json.dumps(body))
    target = body.setdefault(where, {}) if where else body
    for name in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
        target[name] = draw(values)
    if draw(st.booleans()) and "max_new_tokens" not in target and "max_tokens" not in target:
        target["max_new_tokens" if where else "max_tokens"] = 4  # keep most generations short
    text = json.dumps(body) if draw(st.booleans()) else json.dumps(body, ensure_ascii=False)
    if "deep" in text:
        text = text.replace('"deep"', "[" * 100_000 + "]" * 100_000, 1)
    return route, text


@pytest.fixture(scope="module")
def client(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=ANSWER_WITHIN) as client:
        yield client
    assert_pool_whole(tiny_server.url)
    assert httpx.get(f"{tiny_server.url}/health", timeout=ANSWER_WITHIN).status_code == 200


@seed(20261123)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(request=requests())
def test_no_input_gets_a_5xx_or_hangs(client, request):
    route, text = request
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate written raw: the bytes a client would send for it
        data = text.encode("utf-8", "surrogatepass")
    response = client.post(route, content=data, headers={"content-type": "application/json"})
    assert response.status_code < 500, (route, text[:300], response.status_code, response.text[:300])
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        assert '"error_type":"' not in response.text or '"incomplete' not in response.text, response.text[-300:]
