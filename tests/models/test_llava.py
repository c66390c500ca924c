"""LLaVA natively: Kettle's vision tower, projector and Llama over the paged cache against transformers'
LlavaForConditionalGeneration (float32): logits for prompts with one and two images beside a text-only prompt in
one batch, a prefill chunked inside an image's tokens, and greedy tokens."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from kettle.bench.drive import new_cache, scattered_tables, step
from kettle.models.registry import load_model
from tests.models.family_parity import LOGITS_ATOL
from tests.vision_fixtures import LLAVA_IMAGE_TOKENS, image_bytes, make_llava_folder

PROMPTS = [  # (text, images): the processor expands each <image> into its image tokens
    ("<|im_start|>user\n<image>What is in the picture?<|im_end|>\n", [(40, 30)]),
    ("Hi", []),
    ("Compare <image> with <image> please.", [(32, 32), (64, 20)]),
]


@pytest.fixture(scope="module", params=["clip", "siglip"])
def llava(request, tmp_path_factory):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    folder = make_llava_folder(tmp_path_factory.mktemp("llava"), weights=True, tower=request.param)
    processor = AutoProcessor.from_pretrained(folder)
    reference = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return load_model(str(folder), torch.float32, "cpu"), reference, processor


def inputs_of(processor, text: str, sizes: list[tuple[int, int]]) -> dict:
    images = [Image.open(io.BytesIO(image_bytes("PNG", size, seed=i))) for i, size in enumerate(sizes)]
    return processor(text=text, images=images or None, return_tensors="pt")


def image_rows(model, chunks: list[list[int]], starts: list[int], embeddings: list[torch.Tensor]):
    """The step's image rows: each chunk's image tokens in order, with the embedding rows of its prompt's images
    from prompt position `start` on (`embeddings[i]`: prompt i's image rows, [image tokens, hidden])."""
    rows, values, offset = [], [], 0
    for chunk, start, prompt_rows in zip(chunks, starts, embeddings, strict=True):
        # The prompt's image tokens before this chunk: the chunk's own image tokens continue from there.
        before = int(prompt_rows.shape[0] - sum(t == model.image_token_id for t in chunk)) if start else 0
        taken = 0
        for i, token in enumerate(chunk):
            if token == model.image_token_id:
                rows.append(offset + i)
                values.append(prompt_rows[before + taken])
                taken += 1
        offset += len(chunk)
    if rows:
        model.image_rows.set(torch.tensor(rows), torch.stack(values))


def prompt_embeddings(model, all_inputs: list[dict]) -> list[torch.Tensor]:
    """Each prompt's image rows from one batched encode of every image of the step."""
    pixels = [inputs["pixel_values"] for inputs in all_inputs if "pixel_values" in inputs]
    encoded = model.encode_images(torch.cat(pixels)) if pixels else None
    rows, at = [], 0
    for inputs in all_inputs:
        n = inputs["pixel_values"].shape[0] if "pixel_values" in inputs else 0
        rows.append(encoded[at : at + n].reshape(-1, encoded.shape[-1]) if n else torch.empty(0))
        at += n
    return rows


def test_logits_match_transformers_for_one_and_two_images_beside_text(llava):
    model, reference, processor = llava
    all_inputs = [inputs_of(processor, text, sizes) for text, sizes in PROMPTS]
    chunks = [inputs["input_ids"][0].tolist() for inputs in all_inputs]
    assert [c.count(model.image_token_id) for c in chunks] == [LLAVA_IMAGE_TOKENS * len(s) for _, s in PROMPTS]
    tables, blocks = scattered_tables([len(c) for c in chunks])
    cache = new_cache(model, blocks)
    image_rows(model, chunks, [0] * 3, prompt_embeddings(model, all_inputs))
    logits, _ = step(model, cache, chunks, [0] * 3, tables)
    at = 0
    for inputs, chunk in zip(all_inputs, chunks, strict=True):
        with torch.no_grad():
            expected = reference(**inputs).logits[0]
        assert torch.allclose(logits[at : at + len(chunk)], expected, atol=LOGITS_ATOL), (
            (logits[at : at + len(chunk)] - expected).abs().max()
        )
        at += len(chunk)
    assert model.image_rows.rows is None  # placed once, then forgotten
    # The images matter: the same tokens without their embeddings give other logits.
    without, _ = step(model, new_cache(model, blocks), chunks, [0] * 3, tables)
    assert (without[: len(chunks[0])] - logits[: len(chunks[0])]).abs().max() > 1e-2


def test_a_prefill_chunked_inside_an_image(llava):
    model, reference, processor = llava
    inputs = inputs_of(processor, *PROMPTS[2])
    ids = inputs["input_ids"][0].tolist()
    cut = ids.index(model.image_token_id) + 5  # the first chunk ends inside the first image's tokens
    (embeddings,) = prompt_embeddings(model, [inputs])
    tables, blocks = scattered_tables([len(ids)])
    cache = new_cache(model, blocks)
    image_rows(model, [ids[:cut]], [0], [embeddings])
    first, _ = step(model, cache, [ids[:cut]], [0], tables)
    image_rows(model, [ids[cut:]], [cut], [embeddings])
    second, _ = step(model, cache, [ids[cut:]], [cut], tables)
    with torch.no_grad():
        expected = reference(**inputs).logits[0]
    assert torch.allclose(torch.cat([first, second]), expected, atol=LOGITS_ATOL)


def test_greedy_tokens_match_transformers(llava):
    model, reference, processor = llava
    inputs = inputs_of(processor, *PROMPTS[0])
    ids = inputs["input_ids"][0].tolist()
    new_tokens = 8
    with torch.no_grad():
        expected = reference.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)[0, len(ids) :].tolist()
    tables, blocks = scattered_tables([len(ids) + new_tokens])
    cache = new_cache(model, blocks)
    image_rows(model, [ids], [0], prompt_embeddings(model, [inputs]))
    logits, _ = step(model, cache, [ids], [0], tables)
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < new_tokens:
        logits, _ = step(model, cache, [[tokens[-1]]], [len(ids) + len(tokens) - 1], tables)
        tokens.append(int(logits[-1].argmax()))
    assert tokens == expected[: len(tokens)]
