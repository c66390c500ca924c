"""Structured output and tools on the real server (docs/api.md, Structured output and tools): the tiny random
model must still obey the grammar token by token, so every output parses and validates; real clients (openai SDK,
huggingface_hub)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from huggingface_hub import InferenceClient
from openai import OpenAI, UnprocessableEntityError
from transformers import AutoTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def client(tiny_server):
    return OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused")


def generate(server, grammar: dict, seed: int, max_new_tokens: int = 60) -> dict:
    parameters = {"grammar": grammar, "seed": seed, "do_sample": True, "max_new_tokens": max_new_tokens}
    body = {"inputs": "A person:", "parameters": {**parameters, "details": True}}
    response = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_json_schema_outputs_validate_for_20_seeds(tiny_server):
    for seed in range(20):
        answer = generate(tiny_server, {"type": "json", "value": SCHEMA}, seed, max_new_tokens=120)
        assert answer["details"]["finish_reason"] == "eos_token", answer
        jsonschema.validate(json.loads(answer["generated_text"]), SCHEMA)


def test_regex_outputs_all_match(tiny_server):
    pattern = r"(cat|dog)-[0-9]{2,4}"
    for seed in range(10):
        answer = generate(tiny_server, {"type": "regex", "value": pattern}, seed)
        assert re.fullmatch(pattern, answer["generated_text"]), answer["generated_text"]
    # best_of: every candidate has its own matcher.
    body = {
        "inputs": "Pet:",
        "parameters": {
            "grammar": {"type": "regex", "value": pattern},
            "best_of": 2,
            "do_sample": True,
            "details": True,
        },
    }
    answer = httpx.post(f"{tiny_server.url}/generate", json={**body}, timeout=60).json()
    texts = [answer["generated_text"], *(s["generated_text"] for s in answer["details"]["best_of_sequences"])]
    assert len(texts) == 2 and all(re.fullmatch(pattern, t) for t in texts), texts


def test_text_generation_with_grammar_through_huggingface_hub(tiny_server):
    hub = InferenceClient(base_url=tiny_server.url)
    grammar = {"type": "json", "value": SCHEMA}
    text = hub.text_generation(
        "A person:", max_new_tokens=120, grammar=grammar, seed=3, do_sample=True, return_full_text=False
    )
    jsonschema.validate(json.loads(text), SCHEMA)


def test_chat_response_format_json_schema(client, tiny_server, tiny_llama_path):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    kwargs = {"model": "tgi", "messages": MESSAGES, "max_tokens": 120, "seed": 5, "response_format": response_format}
    answer = client.chat.completions.create(**kwargs)
    content = answer.choices[0].message.content
    jsonschema.validate(json.loads(content), SCHEMA)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    # Usage counts the real tokens: one chunk per generated token after the role chunk, and the template's prompt.
    token_chunks = [c for c in chunks if c.choices][1:]
    assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens == len(token_chunks)
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert answer.usage.prompt_tokens == len(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def test_grammar_errors_are_422(client, tiny_server):
    with pytest.raises(UnprocessableEntityError) as caught:
        client.chat.completions.create(
            model="tgi", messages=MESSAGES, tools=[TOOL], response_format={"type": "json_object"}
        )
    assert caught.value.body == "Tool error: Grammar and tools are mutually exclusive"
    bad_schema = {"inputs": "x", "parameters": {"grammar": {"type": "json", "value": {"type": "nope"}}}}
    response = httpx.post(f"{tiny_server.url}/generate", json=bad_schema)
    assert response.status_code == 422 and response.json()["error_type"] == "validation"
    assert response.json()["error"] == "Input validation error: grammar is not valid: Invalid type: nope"
    bad_regex = {"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "(ab"}}}
    response = httpx.post(f"{tiny_server.url}/generate", json=bad_regex)
    assert response.status_code == 422 and "unclosed group" in response.json()["error"]
