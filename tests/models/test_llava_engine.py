"""LLaVA through the shard's engine (the paged runner with image rows): requests carrying images as the router
sends them (bytes and token runs in pb.Request.images), batched with a text request, prefilled in chunks that
end inside an image, and reusing a cached prefix that ends inside an image; greedy tokens against transformers'
LlavaForConditionalGeneration."""

from __future__ import annotations

import hashlib
import io

import pytest
import torch
from PIL import Image

from kettle.proto import generate_pb2 as pb
from tests.models.engine_driver import BLOCK, make_batch, run_to_end, warm_engine
from tests.vision_fixtures import LLAVA_IMAGE_TOKENS, image_bytes, make_llava_folder

NEW_TOKENS = 6
PROMPTS = [  # (text, image sizes)
    ("<|im_start|>user\n<image>What is in the picture?<|im_end|>\n", [(40, 30)]),
    ("Hi there", []),
    ("Compare <image> with <image> please.", [(32, 32), (64, 20)]),
]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    folder = make_llava_folder(tmp_path_factory.mktemp("llava"), weights=True)
    engine, info = warm_engine(folder)
    reference = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return engine, info, reference, AutoProcessor.from_pretrained(folder)


def prepared(processor, reference, text: str, sizes: list[tuple[int, int]]):
    """(prompt ids, pb.Image list as the router builds them, transformers' greedy tokens)."""
    files = [image_bytes("PNG", size, seed=i) for i, size in enumerate(sizes)]
    images = [Image.open(io.BytesIO(f)) for f in files]
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    token = reference.config.image_token_id
    runs, cursor = [], 0
    for data in files:  # each image's run of LLAVA_IMAGE_TOKENS tokens, in order
        cursor = ids.index(token, cursor)
        digest = hashlib.blake2b(data, digest_size=16).digest()
        runs.append(pb.Image(data=data, digest=digest, start=cursor, length=LLAVA_IMAGE_TOKENS))
        cursor += LLAVA_IMAGE_TOKENS
    return ids, runs, out[0, len(ids) :].tolist()


def with_images(batch: pb.Batch, images: list[list[pb.Image]]) -> pb.Batch:
    for request, runs in zip(batch.requests, images, strict=True):
        request.images.extend(runs)
    return batch


def test_the_shard_says_it_takes_images(llava):
    assert llava[1].takes_images


def test_image_and_text_requests_in_one_batch(llava):
    engine, _, reference, processor = llava
    cases = [prepared(processor, reference, *p) for p in PROMPTS]
    batch = with_images(make_batch(1, [c[0] for c in cases], 10, NEW_TOKENS), [c[1] for c in cases])
    tokens = run_to_end(engine, batch)
    assert [tokens[10 + i] for i in range(3)] == [c[2] for c in cases]


def test_a_prefill_in_chunks_that_end_inside_images(llava):
    engine, _, reference, processor = llava
    ids, runs, expected = prepared(processor, reference, *PROMPTS[2])
    batch = with_images(make_batch(2, [ids], 20, NEW_TOKENS, chunk_len=7), [runs])
    assert run_to_end(engine, batch)[20] == expected


def test_a_cached_prefix_that_ends_inside_an_image(llava):
    engine, _, reference, processor = llava
    ids, runs, expected = prepared(processor, reference, *PROMPTS[0])
    assert runs[0].start < BLOCK < runs[0].start + runs[0].length  # the first block ends inside the image
    first = with_images(make_batch(3, [ids], 30, NEW_TOKENS), [runs])
    assert run_to_end(engine, first)[30] == expected
    # The same prompt again, reading the first block from the cache, as the router's prefix cache hands it out.
    again = with_images(make_batch(4, [ids], 31, NEW_TOKENS), [runs])
    again.requests[0].blocks[0] = first.requests[0].blocks[0]
    again.requests[0].cache_len = BLOCK
    assert run_to_end(engine, again)[31] == expected


def test_the_images_change_the_answer(llava):
    """The same token ids without their images (image-token embeddings left as they are) answer otherwise."""
    engine, _, reference, processor = llava
    cases = [prepared(processor, reference, *p) for p in (PROMPTS[0], PROMPTS[2])]
    bare = run_to_end(engine, make_batch(5, [c[0] for c in cases], 50, NEW_TOKENS))
    assert [bare[50], bare[51]] != [cases[0][2], cases[1][2]]
