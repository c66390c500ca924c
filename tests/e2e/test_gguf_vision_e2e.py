"""A vision-language GGUF pair through the real server (launcher, preparation, shard, router): a tiny SmolVLM
(Idefics3) as llama.cpp publishes it, the language model's GGUF passed as --model-id and its mmproj file found
beside it; the `openai` client's image_url part answered token for token as transformers' greedy answer, the
image's tokens (its tiles) counted in usage."""

from __future__ import annotations

import io

import pytest
import torch
from openai import OpenAI
from PIL import Image

from kettle.bench.process import KettleServer
from tests.mmproj_files import write_pair
from tests.vision_fixtures import data_url, image_bytes, make_idefics3_folder

NEW_TOKENS = 6
PNG = image_bytes("PNG", (60, 40), seed=3)  # larger than a tile: a grid of tiles plus the whole image


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    root = tmp_path_factory.mktemp("smolvlm-gguf")
    folder = make_idefics3_folder(root / "hf", weights=True)
    model = Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    language, _ = write_pair(model, folder, root / "gguf", "llama", "idefics3")
    return language, model, AutoProcessor.from_pretrained(folder), root / "kettle-cache"


@pytest.fixture(scope="module")
def server(reference):
    language, _, _, cache = reference
    flags = ("--max-input-tokens", "200", "--max-total-tokens", "256", "--kv-cache-dtype", "float32")
    server = KettleServer(str(language), *flags, env={"KETTLE_CACHE": str(cache)})
    yield server
    assert server.stop() == 0, server.logs()


def test_openai_client_sends_an_image_to_a_gguf_with_its_mmproj(server, reference):
    _, model, processor, _ = reference
    rendered = "<|im_start|>user\nWhat is in<image><|im_end|>\n<|im_start|>assistant\n"
    inputs = processor(text=rendered, images=[[Image.open(io.BytesIO(PNG))]], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    prompt_length = inputs["input_ids"].shape[1]
    text = processor.tokenizer.decode(out[0, prompt_length:], skip_special_tokens=True)

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    content = [{"type": "text", "text": "What is in"}, {"type": "image_url", "image_url": {"url": data_url(PNG)}}]
    answer = client.chat.completions.create(
        model="tgi", messages=[{"role": "user", "content": content}], max_tokens=NEW_TOKENS, temperature=0
    )
    assert answer.choices[0].message.content == text
    assert answer.usage.prompt_tokens == prompt_length > 4 * 5  # the grid of tiles and the whole image
