"""The OpenAI routes over the fake Infer of test_http_api: shapes, SSE framing, usage, field mapping, 422s."""

from __future__ import annotations

import copy
import json

import pytest
from fastapi.testclient import TestClient

from kettle.router import openai_mapping
from kettle.router.app import create_app
from kettle.router.config import RouterConfig
from kettle.router.tokenizer import TokenizerPool
from kettle.router.validation import Validation
from tests.fixtures import CHATML_TEMPLATE
from tests.unit.test_http_api import INFO, LIMITS, TEMPERATURE_ERROR, FakeInfer, scripted

USER = [{"role": "user", "content": "Hello world!"}]
RENDERED = "<|im_start|>user\nHello world!<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def validation(tiny_tokenizer):
    pool = TokenizerPool(lambda: copy.deepcopy(tiny_tokenizer), workers=1)
    yield Validation(LIMITS, pool)
    pool.close()


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat-model")
    (folder / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|e|>"}))
    return folder


@pytest.fixture
def make_client(validation, model_folder):
    def make(infer: FakeInfer | None = None, folder=None, **settings) -> TestClient:
        paths = {"master_shard_uds_path": "/tmp/none", "tokenizer_name": str(folder or model_folder)}
        config = RouterConfig(**paths, model_id="tiny", **settings)
        return TestClient(create_app(config, infer or FakeInfer(), validation, INFO, LIMITS))

    return make


def sse_frames(text: str) -> list:
    """The events of an OpenAI stream: JSON payloads, then the literal "[DONE]"."""
    frames = text.split("\n\n")
    assert frames[-1] == "" and all(frame.startswith("data: ") for frame in frames[:-1])
    payloads = [frame.removeprefix("data: ") for frame in frames[:-1]]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def prompt_tokens(tokenizer, text: str = RENDERED) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_chat_completion_shape_and_usage(make_client, tiny_tokenizer):
    infer = FakeInfer()
    response = make_client(infer).post("/v1/chat/completions", json={"model": "x", "messages": USER})
    assert response.status_code == 200
    answer = response.json()
    assert answer["object"] == "chat.completion" and answer["model"] == "tiny"
    assert answer["id"].startswith("chatcmpl-") and isinstance(answer["created"], int) and answer["system_fingerprint"]
    assert answer["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "The capital is"},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    n = prompt_tokens(tiny_tokenizer)
    assert answer["usage"] == {"prompt_tokens": n, "completion_tokens": 3, "total_tokens": n + 3}
    assert infer.requests[0].inputs == RENDERED and response.headers["x-prompt-tokens"] == str(n)


def test_content_parts_and_continuation(make_client):
    infer = FakeInfer()
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world!"}]
    messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": "Sure:"}]
    make_client(infer).post("/v1/chat/completions", json={"messages": messages})
    assert infer.requests[0].inputs == RENDERED + "Sure:"


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/chat_tokenize"])
def test_an_image_part_is_refused_by_name_not_dropped(make_client, route):
    """A text model's server refuses what it cannot read, naming it (it used to be the schema's three failed
    alternatives: `content.str`, `content.list[TextPart].0.type`, `...text: Field required`)."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    content = [{"type": "text", "text": "What is in this picture?"}, image]
    infer = FakeInfer()
    response = make_client(infer).post(route, json={"messages": [{"role": "user", "content": content}]})
    assert response.status_code == 422 and response.json()["error_type"] == "validation"
    assert response.json()["error"] == (
        "Input validation error: content parts of type `image_url` are not supported: this server reads text parts only"
    )
    assert not infer.requests


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, {"do_sample": True, "temperature": 1.0, "top_p": 1.0}),  # absent temperature samples (TGI)
        ({"temperature": 0}, {"do_sample": False}),
        ({"temperature": 0.5, "top_p": 1.0, "seed": 3}, {"do_sample": True, "temperature": 0.5, "seed": 3}),
        ({"top_p": 0.9, "frequency_penalty": 0.5}, {"top_p": 0.9, "frequency_penalty": 0.5}),
    ],
)
def test_sampling_fields(make_client, fields, expected):
    infer = FakeInfer()
    assert make_client(infer).post("/v1/chat/completions", json={"messages": USER, **fields}).status_code == 200
    parameters = infer.requests[0].parameters
    assert {name: getattr(parameters, name) for name in expected} == expected


def test_max_tokens_alias_and_stop(make_client):
    infer = FakeInfer()
    client = make_client(infer)
    client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 7, "stop": "\n"})
    client.post("/v1/chat/completions", json={"messages": USER, "max_completion_tokens": 5, "stop": ["a", "b"]})
    assert [r.stopping.max_new_tokens for r in infer.requests] == [7, 5]
    assert [r.stopping.stop_sequences for r in infer.requests] == [("\n",), ("a", "b")]


def test_logprobs(make_client):
    infer = FakeInfer()
    body = {"messages": USER, "logprobs": True, "top_logprobs": 2}
    logprobs = make_client(infer).post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]
    assert infer.requests[0].top_n_tokens == 2
    first = logprobs["content"][0]
    assert first == {
        "token": "The",
        "logprob": -0.5,
        "top_logprobs": [{"token": "The", "logprob": -0.5}, {"token": "x", "logprob": -3.0}],
    }
    assert len(logprobs["content"]) == 3


def test_chat_stream(make_client, tiny_tokenizer):
    body = {"messages": USER, "stream": True, "stream_options": {"include_usage": True}}
    response = make_client().post("/v1/chat/completions", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    *chunks, usage_chunk, done = sse_frames(response.text)
    assert done == "[DONE]"
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "tiny" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"]["content"] for c in chunks[1:]] == ["The", " capital", " is"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    n = prompt_tokens(tiny_tokenizer)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": n, "completion_tokens": 3, "total_tokens": n + 3}


def test_stream_without_usage_still_ends_with_done(make_client):
    frames = sse_frames(make_client().post("/v1/chat/completions", json={"messages": USER, "stream": True}).text)
    assert frames[-1] == "[DONE]" and all(f["usage"] is None for f in frames[:-1])


def test_error_inside_a_chat_stream(make_client):
    client = make_client(FakeInfer(scripted(fail_after=1)))
    frames = sse_frames(client.post("/v1/chat/completions", json={"messages": USER, "stream": True}).text)
    message = "Request failed during generation: shard 0 died"
    assert frames[-2:] == [{"error": {"message": message, "http_status_code": 424}}, "[DONE]"]
    assert client.app.state.generation.permits.available == 128


def test_completions_several_prompts(make_client):
    infer = FakeInfer()
    body = {"prompt": ["Hello", "world!"], "max_tokens": 3, "repetition_penalty": 1.2}
    answer = make_client(infer).post("/v1/completions", json=body).json()
    assert answer["object"] == "text_completion"
    assert [(c["index"], c["text"], c["finish_reason"]) for c in answer["choices"]] == [
        (0, "The capital is", "length"),
        (1, "The capital is", "length"),
    ]
    prompt = sum(r.input_length for r in infer.requests)
    assert answer["usage"] == {"prompt_tokens": prompt, "completion_tokens": 6, "total_tokens": prompt + 6}
    assert {r.parameters.repetition_penalty for r in infer.requests} == {1.2}


def test_completions_stream(make_client):
    client = make_client()
    frames = sse_frames(client.post("/v1/completions", json={"prompt": ["a", "b"], "stream": True}).text)
    assert frames[-1] == "[DONE]"
    events = frames[:-1]
    assert all(e["object"] == "text_completion" for e in events)
    for index in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == "The capital is"
        assert [c["finish_reason"] for c in mine] == [None, None, "length"]
    assert client.app.state.generation.permits.available == 128


VALIDATION = "validation"


@pytest.mark.parametrize(
    ("route", "body", "message"),
    [
        ("/v1/chat/completions", {"messages": USER, "n": 2}, "`n` > 1 is not supported yet"),
        ("/v1/chat/completions", {"messages": USER, "logit_bias": {"1": 2.0}}, "`logit_bias` is not supported yet"),
        ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "xml"}}, "`response_format` type"),
        (
            "/v1/chat/completions",
            {"messages": USER, "response_format": {"type": "regex", "value": "a(b"}},
            "grammar is not valid: at 1(8): invalid regex",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 1}}}},
            "grammar is not valid: ",
        ),
        ("/v1/chat/completions", {"messages": USER, "presence_penalty": 2.5}, "`presence_penalty` must be >= -2.0"),
        ("/v1/completions", {"prompt": "a", "logprobs": -1}, "`logprobs` must be >= 0. Given: -1"),
        ("/v1/chat/completions", {"messages": USER, "temperature": -1}, TEMPERATURE_ERROR),
        ("/v1/completions", {"prompt": []}, "`prompt` cannot be an empty list"),
        ("/v1/completions", {"prompt": "a", "top_p": 1.5}, "`top_p` must be > 0.0 and < 1.0"),
        # OpenAI's own fields this server does not serve are refused when set, never dropped.
        ("/v1/completions", {"prompt": "a", "echo": True}, "`echo` is not supported yet"),
        ("/v1/chat/completions", {"messages": USER, "functions": [{"name": "f"}]}, "use `tools` and `tool_choice`"),
        ("/v1/chat/completions", {"messages": USER, "function_call": "auto"}, "`function_call` are not supported"),
    ],
)
def test_unsupported_and_invalid_fields_are_422(make_client, route, body, message):
    client = make_client()
    response = client.post(route, json=body)
    assert response.status_code == 422
    assert response.json()["error_type"] == "validation" and message in response.json()["error"]
    assert response.json()["error"].startswith("Input validation error: ")
    assert client.app.state.generation.permits.available == 128


def test_fields_outside_openais_api_are_ignored_and_named_once_in_the_log(make_client, caplog, monkeypatch):
    """A gateway forwards its own fields at neutral values (vllm-router's, here): served, each named once in the
    log. OpenAI's `user` (an end-user label) and `echo: false` are plain OpenAI and log nothing."""
    monkeypatch.setattr(openai_mapping, "_noted", set())  # a fresh process: nothing named yet
    client = make_client()
    gateway = {"ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False}
    with caplog.at_level("WARNING", logger="kettle.router.openai_mapping"):
        for _ in range(2):
            body = {"messages": USER, "user": "user-1234", **gateway}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            assert client.post("/v1/completions", json={"prompt": "a", "echo": False, **gateway}).status_code == 200
    named = sorted(record.getMessage() for record in caplog.records)
    expected = (f"OpenAI request field `{field}` is not supported by this server and is ignored" for field in gateway)
    assert named == sorted(expected)


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (
            {"prompt": "a", "suffix": "b"},
            {
                "error": "Suffix is not supported and can be achieved by preprocessing the prompt.",
                "error_type": "suffix not supported",
            },
        ),
        (
            {"prompt": ["a"] * 5},
            {
                "error": "Number of prompts exceeds the maximum allowed batch size of 4",
                "error_type": "batch size exceeded",
            },
        ),
    ],
)
def test_completions_refusals_have_tgi_error_types(make_client, body, error):
    client = make_client()
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 422 and response.json() == error
    assert client.app.state.generation.permits.available == 128


def test_missing_template_is_a_template_error(make_client, tmp_path):
    response = make_client(folder=tmp_path).post("/v1/chat/completions", json={"messages": USER})
    assert response.status_code == 422
    expected = {"error": "Template error: this model has no chat template", "error_type": "template_error"}
    assert response.json() == expected


def test_models(make_client):
    assert make_client().get("/v1/models").json() == {
        "object": "list",
        "data": [{"id": "tiny", "object": "model", "created": 0, "owned_by": "tiny"}],
    }


def test_chat_tokenize(make_client, tiny_tokenizer):
    answer = make_client().post("/chat_tokenize", json={"messages": USER}).json()
    assert answer["templated_text"] == RENDERED
    tokens = answer["tokenize_response"]
    assert [t["id"] for t in tokens] == tiny_tokenizer(RENDERED, add_special_tokens=False)["input_ids"]
    assert tokens[0] == {"id": tokens[0]["id"], "text": "<|im_start|>", "start": 0, "stop": 12}


def test_invocations_dispatch_on_the_body(make_client):
    client = make_client()
    generate = client.post("/invocations", json={"inputs": "Hi", "parameters": {"return_full_text": False}})
    assert generate.json() == [{"generated_text": "The capital is"}]
    assert client.post("/invocations", json={"messages": USER}).json()["object"] == "chat.completion"
    assert client.post("/invocations", json={"prompt": "Hi"}).json()["object"] == "text_completion"
    unknown = client.post("/invocations", json={"text": "Hi"})
    assert unknown.status_code == 422 and "`inputs`, `messages` or `prompt`" in unknown.json()["error"]
    bad = client.post("/invocations", json={"messages": "no"})
    assert bad.status_code == 422 and bad.json()["error_type"] == "validation"


def test_api_key_covers_openai_generation_routes(make_client):
    client = make_client(api_key="secret")
    assert client.post("/v1/chat/completions", json={"messages": USER}).status_code == 401
    assert client.post("/v1/completions", json={"prompt": "a"}).status_code == 401
    assert client.get("/v1/models").status_code == 200
    authorized = client.post("/v1/completions", json={"prompt": "a"}, headers={"Authorization": "Bearer secret"})
    assert authorized.status_code == 200


def test_completions_logprobs(make_client):
    infer = FakeInfer()
    client = make_client(infer)
    choice = client.post("/v1/completions", json={"prompt": "a", "logprobs": 1}).json()["choices"][0]
    assert infer.requests[0].top_n_tokens == 1
    assert choice["logprobs"] == {
        "tokens": ["The", " capital", " is"],
        "token_logprobs": [-0.5, -0.5, -0.5],
        "top_logprobs": [{"The": -0.5, "x": -3.0}, {" capital": -0.5, "x": -3.0}, {" is": -0.5, "x": -3.0}],
        "text_offset": [0, 3, 11],
    }
    frames = sse_frames(client.post("/v1/completions", json={"prompt": "a", "logprobs": 0, "stream": True}).text)
    streamed = [f["choices"][0]["logprobs"] for f in frames[:-1]]
    assert [(lp["tokens"], lp["text_offset"]) for lp in streamed] == [
        (["The"], [0]),
        ([" capital"], [3]),
        ([" is"], [11]),
    ]
    plain = client.post("/v1/completions", json={"prompt": "a"}).json()["choices"][0]
    assert plain["logprobs"] is None


def test_response_format_and_presence_penalty_reach_the_request(make_client):
    infer = FakeInfer()
    client = make_client(infer)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    formats = [
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        {"type": "json_schema", "value": {"name": "x", "schema": schema}},
        {"type": "regex", "value": "[ab]+"},
        {"type": "text"},
    ]
    for response_format in formats:
        body = {"messages": USER, "response_format": response_format, "presence_penalty": 0.5}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
    grammars = [(r.parameters.grammar_type, r.parameters.grammar) for r in infer.requests]
    assert grammars == [
        (1, '{"type": "object", "properties": {}}'),
        (1, json.dumps(schema)),
        (1, json.dumps(schema)),
        (2, "[ab]+"),
        (0, ""),
    ]
    assert {r.parameters.presence_penalty for r in infer.requests} == {0.5}


def test_disabled_grammar_support_refuses_response_format(model_folder, tiny_tokenizer):
    pool = TokenizerPool(lambda: copy.deepcopy(tiny_tokenizer), workers=1)
    try:
        client = TestClient(
            create_app(
                RouterConfig(master_shard_uds_path="/tmp/none", tokenizer_name=str(model_folder), model_id="t"),
                FakeInfer(),
                Validation(LIMITS, pool, grammar_support=False),
                INFO,
                LIMITS,
            )
        )
        body = {"messages": USER, "response_format": {"type": "json_object"}}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 422
        assert response.json() == {
            "error": "Input validation error: grammar is not supported",
            "error_type": "validation",
        }
    finally:
        pool.close()
