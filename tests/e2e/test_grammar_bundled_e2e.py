"""Tools and structured output with the bundled SmolLM2 model (its context fits TGI's tool prompt; the tiny test
model's 256 positions do not): tool calls whose arguments validate, streamed name-then-arguments deltas, the
`auto` no-tool escape, and a JSON-schema chat answer."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai import OpenAI

from kettle.bench.process import KettleServer

PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather of a city", "parameters": PARAMETERS},
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client():
    server = KettleServer(None)
    yield OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120)
    assert server.stop() == 0, server.logs()


def chat(client, **kwargs):
    return client.chat.completions.create(model="tgi", messages=WEATHER_QUESTION, max_tokens=60, **kwargs)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_call_arguments_validate(client, tool_choice):
    answer = chat(client, tools=[WEATHER, CLOCK], tool_choice=tool_choice, temperature=0)
    message = answer.choices[0].message
    assert message.content is None and answer.choices[0].finish_reason == "tool_calls"
    (call,) = message.tool_calls
    assert call.type == "function" and call.id
    # `required` lets the model pick any offered tool; the arguments must follow the one it picked.
    tools = {"get_weather": PARAMETERS, "get_time": CLOCK["function"]["parameters"]}
    assert call.function.name == "get_weather" or tool_choice == "required"
    jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name])


def test_tool_call_stream_sends_name_then_arguments(client):
    kwargs = {"tools": [WEATHER], "tool_choice": "get_weather", "temperature": 0}
    whole = chat(client, **kwargs)
    chunks = list(chat(client, **kwargs, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].function.name == "get_weather" and deltas[0].id and deltas[0].function.arguments == ""
    assert all(d.function.name is None for d in deltas[1:]) and len(deltas) > 2
    assert "".join(d.function.arguments for d in deltas) == whole.choices[0].message.tool_calls[0].function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_auto_tool_choice_answers_in_text_when_no_tool_fits(client):
    messages = [{"role": "user", "content": "Say hello to me."}]
    answer = client.chat.completions.create(
        model="tgi", messages=messages, tools=[CLOCK], tool_choice="auto", temperature=0, max_tokens=60
    )
    message = answer.choices[0].message
    if message.tool_calls:  # the model may still call the tool; the call must then be well formed
        assert message.tool_calls[0].function.name == "get_time"
        assert json.loads(message.tool_calls[0].function.arguments) == {}
    else:
        assert message.content and answer.choices[0].finish_reason == "stop"
    streamed = list(
        client.chat.completions.create(
            model="tgi", messages=messages, tools=[CLOCK], tool_choice="auto", temperature=0, max_tokens=60, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == (message.content or "")


def test_json_schema_response_format(client):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 30}}, "required": ["capital"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    messages = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    answer = client.chat.completions.create(
        model="tgi", messages=messages, response_format=response_format, temperature=0, max_tokens=40
    )
    content = json.loads(answer.choices[0].message.content)
    jsonschema.validate(content, schema)
    assert "Paris" in content["capital"]
