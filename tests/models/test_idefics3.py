"""Idefics3 (SmolVLM's architecture) natively: Kettle's tower on every tile, the pixel-shuffle connector and Llama
over the paged cache against transformers' Idefics3ForConditionalGeneration (float32): logits for prompts with
one and two images (small ones, one tile; larger ones, a grid of tiles plus the whole image) beside a text-only
prompt in one batch."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from kettle.bench.drive import new_cache, scattered_tables, step
from kettle.models.registry import load_model
from tests.models.family_parity import assert_prompt_logits
from tests.vision_fixtures import IDEFICS3_TILE_TOKENS, image_bytes, make_idefics3_folder

PROMPTS = [  # (text, image sizes)
    ("<|im_start|>user\n<image>What is in the picture?<|im_end|>\n", [(60, 40)]),
    ("Hi", []),
    ("Compare <image> with <image> please.", [(20, 20), (64, 30)]),
]


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    folder = make_idefics3_folder(tmp_path_factory.mktemp("idefics3"), weights=True)
    processor = AutoProcessor.from_pretrained(folder)
    reference = Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return load_model(str(folder), torch.float32, "cpu"), reference, processor


def pictures(sizes):
    return [Image.open(io.BytesIO(image_bytes("PNG", size, seed=i))) for i, size in enumerate(sizes)]


def test_logits_match_transformers_with_tiles_beside_text(idefics3):
    model, reference, processor = idefics3
    all_inputs = [processor(text=t, images=[pictures(s)] if s else None, return_tensors="pt") for t, s in PROMPTS]
    chunks = [inputs["input_ids"][0].tolist() for inputs in all_inputs]
    # Every image of the step in one batch, one list of tiles per image, as the shard sends them.
    images = [image for _, sizes in PROMPTS for image in pictures(sizes)]
    batch = processor.image_processor(images=[[image] for image in images], return_tensors="pt")
    rows = torch.cat(model.encode_images(**batch))
    token = model.image_token_id
    flat = [t for chunk in chunks for t in chunk]
    assert rows.shape[0] == flat.count(token) > 4 * 5  # the larger image takes a grid of tiles
    model.image_rows.set(torch.tensor([i for i, t in enumerate(flat) if t == token]), rows)
    tables, blocks = scattered_tables([len(c) for c in chunks])
    logits, _ = step(model, new_cache(model, blocks), chunks, [0] * 3, tables)
    assert_prompt_logits(logits, reference, all_inputs, chunks)


NEW_TOKENS = 6


@pytest.fixture(scope="module")
def engine(idefics3, tmp_path_factory):
    from tests.models.engine_driver import warm_engine

    return warm_engine(make_idefics3_folder(tmp_path_factory.mktemp("idefics3-engine"), weights=True))[0]


def request_of(processor, reference, text: str, sizes):
    """(prompt ids, pb.Image list as the router builds them, transformers' greedy tokens)."""
    import hashlib

    from kettle.proto import generate_pb2 as pb

    files = [image_bytes("PNG", size, seed=i) for i, size in enumerate(sizes)]
    images = [Image.open(io.BytesIO(f)) for f in files]
    inputs = processor(text=text, images=[images] if images else None, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    token = reference.config.image_token_id
    where = [i for i, t in enumerate(ids) if t == token]
    # Each image's share of the image tokens: its tiles (grid and whole image) x 4, as the router counts them.
    per_image = [IDEFICS3_TILE_TOKENS * n for n in _tiles_per_image(processor, images)] if images else []
    assert sum(per_image) == len(where)
    runs, at = [], 0
    for data, length in zip(files, per_image, strict=True):
        digest = hashlib.blake2b(data, digest_size=16).digest()
        runs.append(pb.Image(data=data, digest=digest, start=where[at], length=length))
        at += length
    return ids, runs, out[0, len(ids) :].tolist()


def _tiles_per_image(processor, images) -> list[int]:
    batch = processor.image_processor(images=[[image] for image in images], return_tensors="pt")
    return [int((tiles.flatten(1) != 0).any(1).sum()) for tiles in batch["pixel_values"]]


def test_the_engine_serves_tiles_in_batches_and_chunks(engine, idefics3):
    from tests.models.engine_driver import make_batch, run_to_end

    _, reference, processor = idefics3
    cases = [request_of(processor, reference, *p) for p in PROMPTS]
    batch = make_batch(1, [c[0] for c in cases], 10, NEW_TOKENS)
    for request, case in zip(batch.requests, cases, strict=True):
        request.images.extend(case[1])
    tokens = run_to_end(engine, batch)
    assert [tokens[10 + i] for i in range(3)] == [c[2] for c in cases]
    chunked = make_batch(2, [cases[2][0]], 20, NEW_TOKENS, chunk_len=7)  # chunks end inside tiles and tags
    chunked.requests[0].images.extend(cases[2][1])
    assert run_to_end(engine, chunked)[20] == cases[2][2]
