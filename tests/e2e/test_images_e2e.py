"""Images through the real server (launcher, shard, router) on a tiny LLaVA: the `openai` client's image_url
parts (a data URL, and an http URL the router fetches from a server on 127.0.0.1) and the `text-generation`
client's Markdown images, each answer token for token transformers' greedy one; usage counting the image tokens;
a repeated image served from the prefix cache; a refused image as the clients see it."""

from __future__ import annotations

import http.server
import io
import re
import threading

import httpx
import pytest
import torch
from openai import OpenAI, UnprocessableEntityError
from PIL import Image

from kettle.bench.process import KettleServer
from tests.e2e.kv_pool import assert_pool_whole
from tests.vision_fixtures import (
    LLAVA_IMAGE_TOKENS,
    data_url,
    image_bytes,
    make_idefics3_folder,
    make_llava_folder,
    make_qwen2_vl_folder,
    qwen2_vl_inputs,
)

NEW_TOKENS = 6
PNG = image_bytes("PNG", (40, 30), seed=3)
_HIT_TOKENS = re.compile(r"^kettle_prefix_cache_hit_tokens_total (\S+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_llava_folder(tmp_path_factory.mktemp("llava"), weights=True)


@pytest.fixture(scope="module")
def server(folder):
    flags = ("--max-input-tokens", "200", "--max-total-tokens", "256", "--kv-cache-dtype", "float32")
    server = KettleServer(str(folder), *flags)
    yield server
    try:
        assert_pool_whole(server.url)  # no KV block left referenced once every request is done
    finally:
        code = server.stop()
    assert code == 0, server.logs()


@pytest.fixture(scope="module")
def reference(folder):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(folder)


@pytest.fixture(scope="module")
def image_site():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/cat.png" else 404)
            self.send_header("Content-Length", str(len(PNG) if self.path == "/cat.png" else 0))
            self.end_headers()
            if self.path == "/cat.png":
                self.wfile.write(PNG)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def expected(reference, text: str) -> tuple[list[int], str]:
    """transformers' greedy tokens (and their text) for `text` with PNG at its one <image>; and the prompt length."""
    model, processor = reference
    inputs = processor(text=text, images=[Image.open(io.BytesIO(PNG))], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    tokens = out[0, inputs["input_ids"].shape[1] :].tolist()
    return tokens, processor.tokenizer.decode(tokens, skip_special_tokens=True), inputs["input_ids"].shape[1]


def chat(client: OpenAI, url: str, **extra):
    content = [{"type": "text", "text": "What is in"}, {"type": "image_url", "image_url": {"url": url}}]
    messages = [{"role": "user", "content": content}]
    return client.chat.completions.create(model="tgi", messages=messages, max_tokens=NEW_TOKENS, temperature=0, **extra)


def hit_tokens(server) -> float:
    return float(_HIT_TOKENS.search(httpx.get(f"{server.url}/metrics").text).group(1))


def test_openai_client_sends_an_image(server, reference):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    rendered = "<|im_start|>user\nWhat is in<image><|im_end|>\n<|im_start|>assistant\n"
    _, text, prompt_length = expected(reference, rendered)
    answer = chat(client, data_url(PNG))
    assert answer.choices[0].message.content == text
    assert answer.usage.prompt_tokens == prompt_length > LLAVA_IMAGE_TOKENS
    # The same image and text again: its blocks come from the prefix cache, image tokens included.
    before = hit_tokens(server)
    assert chat(client, data_url(PNG)).choices[0].message.content == text
    assert hit_tokens(server) - before >= 16


def test_an_image_url_fetched_by_the_router(server, reference, image_site):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    assert (
        chat(client, f"{image_site}/cat.png").choices[0].message.content
        == chat(client, data_url(PNG)).choices[0].message.content
    )
    with pytest.raises(UnprocessableEntityError) as error:
        chat(client, f"{image_site}/missing.png")
    message = error.value.response.json()["error"]
    assert message == f"Input validation error: image 0: fetching {image_site}/missing.png answered HTTP 404"


def test_text_generation_client_sends_a_markdown_image(server, reference):
    from text_generation import Client

    tokens, _, _ = expected(reference, "Describe <image> briefly.")
    response = Client(server.url, timeout=60).generate(
        f"Describe ![]({data_url(PNG)}) briefly.", max_new_tokens=NEW_TOKENS
    )
    assert [t.id for t in response.details.tokens] == tokens


def test_a_refused_image_reaches_the_client_as_a_422(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    with pytest.raises(UnprocessableEntityError) as error:
        chat(client, data_url(image_bytes("BMP"), "image/bmp"))
    message = error.value.response.json()["error"]
    assert message == "Input validation error: image 0 is BMP, not a format this server reads (PNG, JPEG, WebP, GIF)"


def test_a_streamed_answer_with_an_image_is_the_whole_one(server):
    """The same tokens streamed as answered whole (compared by token: the tiny model's byte tokens may end the
    text inside a UTF-8 character, which the two paths render differently)."""
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    whole = chat(client, data_url(PNG), logprobs=True).choices[0].logprobs.content
    chunks = chat(client, data_url(PNG), logprobs=True, stream=True, stream_options={"include_usage": True})
    streamed, usage = [], None
    for chunk in chunks:
        for choice in chunk.choices:
            streamed.extend(choice.logprobs.content if choice.logprobs else [])
        usage = chunk.usage or usage
    assert [t.token for t in streamed] == [t.token for t in whole]
    assert usage.prompt_tokens > LLAVA_IMAGE_TOKENS


def test_a_grammar_applies_to_an_answer_about_an_image(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    response_format = {"type": "regex", "value": "[ab]{4}"}
    answer = chat(client, data_url(PNG), extra_body={"response_format": response_format})
    assert re.fullmatch("[ab]{4}", answer.choices[0].message.content)


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    folder = make_idefics3_folder(tmp_path_factory.mktemp("idefics3"), weights=True)
    flags = ("--max-input-tokens", "200", "--max-total-tokens", "256", "--kv-cache-dtype", "float32")
    server = KettleServer(str(folder), *flags)
    model = Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    yield server, model, AutoProcessor.from_pretrained(folder)
    try:
        assert_pool_whole(server.url)
    finally:
        code = server.stop()
    assert code == 0, server.logs()


def test_idefics3_answers_about_a_tiled_image(idefics3):
    """A SmolVLM-architecture model through the real server: an image cut into tiles, the answer transformers'."""
    server, model, processor = idefics3
    png = image_bytes("PNG", (64, 30), seed=1)
    rendered = "<|im_start|>user\nWhat is in<image><|im_end|>\n<|im_start|>assistant\n"
    inputs = processor(text=rendered, images=[[Image.open(io.BytesIO(png))]], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    text = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    answer = chat(OpenAI(base_url=f"{server.url}/v1", api_key="unused"), data_url(png))
    assert answer.usage.prompt_tokens == inputs["input_ids"].shape[1]
    assert answer.choices[0].message.content == text


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    from transformers import Qwen2VLForConditionalGeneration

    folder = make_qwen2_vl_folder(tmp_path_factory.mktemp("qwen2_vl"), weights=True)
    flags = ("--max-input-tokens", "200", "--max-total-tokens", "256", "--kv-cache-dtype", "float32")
    server = KettleServer(str(folder), *flags)
    model = Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    yield server, model, folder
    try:
        assert_pool_whole(server.url)
    finally:
        code = server.stop()
    assert code == 0, server.logs()


def test_qwen2_vl_answers_at_its_multimodal_positions(qwen2_vl):
    """A Qwen2-VL through the real server: an image_url part (twice: the second from the prefix cache) and a Markdown
    image, each answer transformers' (its decode positions continue from the image's grid, not the token count)."""
    from text_generation import Client
    from transformers import AutoTokenizer

    server, model, folder = qwen2_vl
    tokenizer = AutoTokenizer.from_pretrained(folder)
    png, image = image_bytes("PNG", (100, 80), seed=1), "<|vision_start|><|image_pad|><|vision_end|>"

    def greedy(text: str) -> tuple[list[int], str, int]:
        inputs = qwen2_vl_inputs(folder, text, [png])
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        tokens = out[0, inputs["input_ids"].shape[1] :].tolist()
        return tokens, tokenizer.decode(tokens, skip_special_tokens=True), inputs["input_ids"].shape[1]

    _, text, prompt_length = greedy(f"<|im_start|>user\nWhat is in{image}<|im_end|>\n<|im_start|>assistant\n")
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    answer = chat(client, data_url(png))
    assert answer.choices[0].message.content == text
    assert answer.usage.prompt_tokens == prompt_length > 56  # the image's 14 x 16 patches, merged 2 x 2
    before = hit_tokens(server)
    assert chat(client, data_url(png)).choices[0].message.content == text
    assert hit_tokens(server) - before >= 16
    tokens, _, _ = greedy(f"Describe {image} briefly.")
    response = Client(server.url, timeout=60).generate(
        f"Describe ![]({data_url(png)}) briefly.", max_new_tokens=NEW_TOKENS
    )
    assert [t.id for t in response.details.tokens] == tokens
