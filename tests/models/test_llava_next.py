"""LLaVA-NeXT natively: any-resolution tiles, the unpadded grid with its newline rows, over Kettle's Llama,
against transformers' LlavaNextForConditionalGeneration (float32): logits for images of several shapes beside a
text prompt in one batch, the router's image token counts, and the engine's greedy tokens."""

from __future__ import annotations

import hashlib
import io

import pytest
import torch
from PIL import Image

from kettle.bench.drive import new_cache, scattered_tables, step
from kettle.models.registry import load_model
from kettle.proto import generate_pb2 as pb
from kettle.router.images import tokens as image_tokens
from tests.models.engine_driver import make_batch, run_to_end, warm_engine
from tests.models.family_parity import assert_prompt_logits
from tests.vision_fixtures import image_bytes, make_llava_next_folder

PROMPTS = [  # (text, image sizes (width, height))
    ("<|im_start|>user\n<image>What is in the picture?<|im_end|>\n", [(60, 25)]),
    ("Hi", []),
    ("Compare <image> with <image> please.", [(30, 70), (50, 50)]),
]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory):
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    folder = make_llava_next_folder(tmp_path_factory.mktemp("llava-next"), weights=True)
    reference = LlavaNextForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, load_model(str(folder), torch.float32, "cpu"), reference, AutoProcessor.from_pretrained(folder)


def files_of(sizes):
    return [image_bytes("PNG", size, seed=i) for i, size in enumerate(sizes)]


def pictures(files):
    return [Image.open(io.BytesIO(f)) for f in files]


def test_logits_match_transformers_and_the_router_counts_the_tokens(llava_next):
    folder, model, reference, processor = llava_next
    counter = image_tokens.for_model(folder)
    all_inputs = [processor(text=t, images=pictures(files_of(s)) or None, return_tensors="pt") for t, s in PROMPTS]
    chunks = [inputs["input_ids"][0].tolist() for inputs in all_inputs]
    token = model.image_token_id
    for chunk, (_, sizes) in zip(chunks, PROMPTS, strict=True):
        assert chunk.count(token) == sum(counter.count(*size) for size in sizes)
    images = [image for _, sizes in PROMPTS for image in pictures(files_of(sizes))]
    batch = processor.image_processor(images=images, return_tensors="pt")
    rows = torch.cat(model.encode_images(**batch))
    flat = [t for chunk in chunks for t in chunk]
    model.image_rows.set(torch.tensor([i for i, t in enumerate(flat) if t == token]), rows)
    tables, blocks = scattered_tables([len(c) for c in chunks])
    logits, _ = step(model, new_cache(model, blocks), chunks, [0] * 3, tables)
    assert_prompt_logits(logits, reference, all_inputs, chunks)


def test_the_engine_gives_transformers_greedy_tokens(llava_next):
    folder, model, reference, processor = llava_next
    engine = warm_engine(folder)[0]
    counter = image_tokens.for_model(folder)
    batch = make_batch(1, [], 10, NEW_TOKENS)
    expected = []
    for i, (text, sizes) in enumerate(PROMPTS):
        files = files_of(sizes)
        inputs = processor(text=text, images=pictures(files) or None, return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
        with torch.no_grad():
            out = reference.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
        expected.append(out[0, len(ids) :].tolist())
        request = make_batch(1, [ids], 10 + i, NEW_TOKENS, chunk_len=9).requests[0]  # chunks end inside images
        where, at = [j for j, t in enumerate(ids) if t == model.image_token_id], 0
        for data, size in zip(files, sizes, strict=True):
            length = counter.count(*size)
            digest = hashlib.blake2b(data, digest_size=16).digest()
            request.images.append(pb.Image(data=data, digest=digest, start=where[at], length=length))
            at += length
        batch.requests.append(request)
    tokens = run_to_end(engine, batch)
    assert [tokens[10 + i] for i in range(3)] == expected
