"""The OpenAI routes on the real server, driven by the `openai` SDK and huggingface_hub's InferenceClient."""

from __future__ import annotations

import httpx
import pytest
from huggingface_hub import InferenceClient
from openai import OpenAI, UnprocessableEntityError
from transformers import AutoTokenizer

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    return AutoTokenizer.from_pretrained(tiny_llama_path)


@pytest.fixture(scope="module")
def client(tiny_server):
    return OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused")


def chat_prompt_tokens(tokenizer, messages=MESSAGES) -> int:
    """The real prompt length: the model's own template, tokenized by the model's tokenizer."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_chat_completion_matches_generate(client, tiny_server, tokenizer):
    answer = client.chat.completions.create(model="tgi", messages=MESSAGES, max_tokens=8, temperature=0)
    choice = answer.choices[0]
    assert answer.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    n = chat_prompt_tokens(tokenizer)
    assert answer.usage.prompt_tokens == n
    assert answer.usage.total_tokens == n + answer.usage.completion_tokens
    # The same prompt through /generate (greedy) gives the same text: one shared request path.
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    body = {"inputs": rendered, "parameters": {"max_new_tokens": 8}}
    assert httpx.post(f"{tiny_server.url}/generate", json=body).json()["generated_text"] == choice.message.content


def test_chat_stream_with_usage(client, tokenizer):
    kwargs = {"model": "tgi", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == chat_prompt_tokens(tokenizer)
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions(client, tokenizer):
    answer = client.completions.create(model="tgi", prompt=["Hello world", "The capital"], max_tokens=4, seed=1)
    assert [c.index for c in answer.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in answer.choices)
    prompt = sum(len(tokenizer(p)["input_ids"]) for p in ("Hello world", "The capital"))
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt, 8)
    streamed = list(client.completions.create(model="tgi", prompt="Hello world", max_tokens=4, stream=True))
    assert streamed[-1].choices[0].finish_reason == "length"


def test_models_and_errors(client):
    assert [m.id for m in client.models.list().data]
    with pytest.raises(UnprocessableEntityError) as caught:
        client.chat.completions.create(model="tgi", messages=MESSAGES, n=2)
    # The SDK keeps the `error` field of the error body (TGI's shape; docs/api.md, Errors).
    assert caught.value.body == "Input validation error: `n` > 1 is not supported yet"


def test_huggingface_hub_client(tiny_server):
    hub = InferenceClient(base_url=tiny_server.url)
    answer = hub.chat_completion(MESSAGES, max_tokens=8, temperature=0)
    assert answer.choices[0].message.role == "assistant" and answer.usage.completion_tokens > 0
    chunks = hub.chat_completion(MESSAGES, max_tokens=8, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == answer.choices[0].message.content
    assert isinstance(hub.text_generation("Hello world", max_new_tokens=4), str)
