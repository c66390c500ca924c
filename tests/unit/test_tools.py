"""Tool calling (docs/api.md, Structured output and tools): the tool grammar, output parsing, streamed deltas, and the
chat route over a fake Infer."""

from __future__ import annotations

import json

import llguidance
import pytest

from kettle.grammar import GRAMMAR_TYPE_JSON, grammar_text
from kettle.router.chat_template import ChatTemplate
from kettle.router.openai_mapping import chat_prompt
from kettle.router.openai_schemas import ChatRequest
from kettle.router.tool_stream import ToolStream
from kettle.router.tools import NO_TOOL, TOOL_PROMPT, ToolError, parse_output, plan_tools
from kettle.shard.grammar import Grammars
from tests.fixtures import CHATML_TEMPLATE
from tests.unit.test_http_api import FakeInfer, scripted
from tests.unit.test_openai_api import USER, make_client, model_folder, sse_frames, validation  # noqa: F401

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CALL = '{"function": {"_name": "get_weather", "city": "Paris \\"Ville\\"", "days": 3}}'
TEXT = '{"function": {"_name": "no_tool", "content": "Bonjour été \\"!\\""}}'
ESCAPED = (
    '{"function": {"_name": "no_tool", "content": "Bonjour \\u00e9t\\u00e9 \\"!\\""}}'  # \\u: streams decode it too
)


def names(plan) -> list[str]:
    return [f["name"] for f in plan.functions]


def test_tool_choice_selects_the_offered_functions():
    assert names(plan_tools([WEATHER], None)) == ["get_weather", NO_TOOL]
    assert names(plan_tools([WEATHER], "auto")) == ["get_weather", NO_TOOL]
    assert names(plan_tools([WEATHER], "required")) == ["get_weather"]
    assert names(plan_tools([WEATHER], "get_weather")) == ["get_weather"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert names(plan_tools([WEATHER], named)) == ["get_weather"]
    assert plan_tools([WEATHER], "none") is None and plan_tools(None, None) is None
    with pytest.raises(ToolError, match="Tool choice 'nope' not found in provided tools"):
        plan_tools([WEATHER], "nope")
    with pytest.raises(ToolError, match="needs `tools`"):
        plan_tools(None, "required")


def accepts(tokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(Grammars(tokenizer, frozenset()).ll_tokenizer, grammar)
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def test_tool_grammar_accepts_calls_and_the_escape_only(tiny_tokenizer):
    grammar = grammar_text(GRAMMAR_TYPE_JSON, json.dumps(plan_tools([WEATHER], "auto").schema))
    assert accepts(tiny_tokenizer, grammar, CALL) and accepts(tiny_tokenizer, grammar, TEXT)
    assert not accepts(tiny_tokenizer, grammar, '{"function": {"_name": "get_time"}}')
    assert not accepts(tiny_tokenizer, grammar, '{"function": {"_name": "get_weather"}}')  # `city` is required
    required = grammar_text(GRAMMAR_TYPE_JSON, json.dumps(plan_tools([WEATHER], "required").schema))
    assert not accepts(tiny_tokenizer, required, TEXT)


def test_parse_output():
    call = parse_output(CALL)
    assert (call.name, json.loads(call.arguments), call.content) == (
        "get_weather",
        {"city": 'Paris "Ville"', "days": 3},
        None,
    )
    assert parse_output(TEXT).content == parse_output(ESCAPED).content == 'Bonjour été "!"'
    assert parse_output('{"function": {"_name": "get_time"}}').arguments == "{}"
    with pytest.raises(ToolError, match="Failed to parse generated text"):
        parse_output(CALL[:30])


@pytest.mark.parametrize("size", [1, 3, 7])
def test_stream_sends_the_name_then_argument_deltas(size):
    stream = ToolStream()
    deltas = [stream.feed(CALL[i : i + size]) for i in range(0, len(CALL), size)]
    sent = [d for d in deltas if d is not None]
    first = sent[0].tool_calls[0]
    assert (first.function.name, first.function.arguments, first.type) == ("get_weather", "", "function") and first.id
    assert all(d.tool_calls[0].function.name is None and d.tool_calls[0].id is None for d in sent[1:])
    assert "".join(d.tool_calls[0].function.arguments for d in sent) == parse_output(CALL).arguments


@pytest.mark.parametrize("size", [1, 2, 5])
def test_stream_of_the_escape_is_its_content(size):
    stream = ToolStream()
    deltas = [stream.feed(ESCAPED[i : i + size]) for i in range(0, len(ESCAPED), size)]
    assert not stream.is_call
    assert "".join(d.content for d in deltas if d is not None) == 'Bonjour été "!"'


def tool_texts(text: str) -> list[str]:
    return [text[i : i + 4] for i in range(0, len(text), 4)]


@pytest.fixture(scope="module")
def tools_folder(tmp_path_factory):
    """A model folder whose template renders `tools` itself (here: just the first name, to keep prompts short)."""
    folder = tmp_path_factory.mktemp("tools-model")
    (folder / "chat_template.jinja").write_text(
        "{% if tools %}{{ tools[0].function.name }};{% endif %}" + CHATML_TEMPLATE
    )
    return folder


def test_tools_follow_the_last_message_when_the_template_ignores_them():
    body = ChatRequest(messages=USER, tools=[WEATHER], tool_prompt="Use a tool.")
    prompt, _ = chat_prompt(ChatTemplate(CHATML_TEMPLATE), body, plan_tools(body.tools, body.tool_choice))
    offered = [{"type": "function", "function": f} for f in plan_tools([WEATHER], "auto").functions]
    assert f"Hello world!\n---\n{json.dumps(offered)}\nUse a tool.<|im_end|>" in prompt
    default, _ = chat_prompt(ChatTemplate(CHATML_TEMPLATE), ChatRequest(messages=USER), plan_tools([WEATHER], None))
    assert default.endswith(f"{TOOL_PROMPT}<|im_end|>\n<|im_start|>assistant\n")


def test_chat_answers_with_tool_calls(make_client, tools_folder):  # noqa: F811
    infer = FakeInfer(scripted(texts=tool_texts(CALL)))
    body = {"messages": USER, "tools": [WEATHER], "tool_choice": "required"}
    answer = make_client(infer, folder=tools_folder).post("/v1/chat/completions", json=body).json()
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": parse_output(CALL).arguments}
    request = infer.requests[0]
    assert request.parameters.grammar_type == GRAMMAR_TYPE_JSON and '"_name"' in request.parameters.grammar
    assert request.inputs.startswith("get_weather;<|im_start|>user\nHello world!<|im_end|>")  # rendered by the template


def test_chat_streams_tool_calls_and_escape_text(make_client, tools_folder):  # noqa: F811
    client = make_client(FakeInfer(scripted(texts=tool_texts(CALL))), folder=tools_folder)
    body = {"messages": USER, "tools": [WEATHER], "stream": True}
    chunks = [f for f in sse_frames(client.post("/v1/chat/completions", json=body).text) if f != "[DONE]"]
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks[1:] if "tool_calls" in c["choices"][0]["delta"]]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"]["arguments"] for c in calls) == parse_output(CALL).arguments
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    client = make_client(FakeInfer(scripted(texts=tool_texts(TEXT))), folder=tools_folder)
    frames = sse_frames(client.post("/v1/chat/completions", json=body).text)
    text = "".join(f["choices"][0]["delta"].get("content") or "" for f in frames if f != "[DONE]")
    assert text == 'Bonjour été "!"'


def test_tools_with_response_format_is_a_tool_error(make_client):  # noqa: F811
    body = {"messages": USER, "tools": [WEATHER], "response_format": {"type": "json_object"}}
    response = make_client().post("/v1/chat/completions", json=body)
    assert response.status_code == 422
    assert response.json() == {
        "error": "Tool error: Grammar and tools are mutually exclusive",
        "error_type": "tool_error",
    }
    response = make_client().post(
        "/v1/chat/completions", json={"messages": USER, "tools": [WEATHER], "tool_choice": "x"}
    )
    assert response.json()["error"] == "Tool error: Tool choice 'x' not found in provided tools"
