"""Gemma 3 with images (a tiny one) through the real server, natively: the `openai` client's image_url part and the
`text-generation` client's Markdown image each get transformers' greedy answer, usage counts the image tokens,
/info says the native path serves it and reads images, and the chat prompt, sent in chunks of 16 tokens (the
router keeping each image's tokens in one chunk: they attend to each other both ways), is answered as a whole
prompt is."""

from __future__ import annotations

import httpx
import pytest
import torch
from openai import OpenAI

from kettle.bench.process import KettleServer
from tests.e2e.kv_pool import assert_pool_whole
from tests.vision_fixtures import GEMMA3_IMAGE_TOKENS, data_url, image_bytes, make_gemma3_folder
from tests.vlm_fallback_fixtures import processed

NEW_TOKENS = 6
PNG = image_bytes("PNG", (40, 30), seed=5)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    folder = make_gemma3_folder(tmp_path_factory.mktemp("gemma3"), weights=True)
    # A prefill budget of 16 tokens: the chat prompt (about 30 tokens) arrives in chunks.
    flags = ("--max-input-tokens", "200", "--max-total-tokens", "256", "--max-batch-prefill-tokens", "16")
    flags += ("--kv-cache-dtype", "float32")  # the answers are compared with transformers' float32 ones
    server = KettleServer(str(folder), *flags)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    yield server, model, folder
    try:
        assert_pool_whole(server.url)
    finally:
        code = server.stop()
    assert code == 0, server.logs()


def greedy(model, folder, text: str) -> tuple[list[int], int]:
    inputs = processed(folder, text, [PNG])
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist(), inputs["input_ids"].shape[1]


def test_gemma3_answers_about_an_image_natively(gemma3):
    from text_generation import Client
    from transformers import AutoTokenizer

    server, model, folder = gemma3
    info = httpx.get(f"{server.url}/info").json()
    assert info["execution_path"] == "native" and info["model_pipeline_tag"] == "image-text-to-text"

    tokens, prompt_length = greedy(model, folder, "<|im_start|>user\nWhat is in<start_of_image><|im_end|>\n"
                                   "<|im_start|>assistant\n")  # fmt: skip
    content = [{"type": "text", "text": "What is in"}, {"type": "image_url", "image_url": {"url": data_url(PNG)}}]
    answer = OpenAI(base_url=f"{server.url}/v1", api_key="unused").chat.completions.create(
        model="tgi", messages=[{"role": "user", "content": content}], max_tokens=NEW_TOKENS, temperature=0
    )
    assert answer.usage.prompt_tokens == prompt_length > 16 + GEMMA3_IMAGE_TOKENS  # so it came in chunks
    text = AutoTokenizer.from_pretrained(folder).decode(tokens, skip_special_tokens=True)
    assert answer.choices[0].message.content == text

    tokens, _ = greedy(model, folder, "Describe <start_of_image> briefly.")
    response = Client(server.url, timeout=60).generate(
        f"Describe ![]({data_url(PNG)}) briefly.", max_new_tokens=NEW_TOKENS
    )
    assert [t.id for t in response.details.tokens] == tokens
