"""A vision-language model with no native family (PaliGemma) through the transformers fallback with its images,
in padded batches and one request per forward (`KETTLE_TUNING=fallback-padding=off`, the path of models whose
cache has sliding-window layers): the shard's engine, driven as the router drives it (image bytes and token runs in
pb.Request.images), gives transformers' greedy tokens for a prompt with an image, for image and text requests in
one batch, and for a prompt with an image that the router sends in chunks ending inside the image."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

from kettle import settings
from kettle.models.registry import ARCHITECTURES
from kettle.proto import generate_pb2 as pb
from kettle.shard.fallback_runner import FallbackRunner
from tests.models.engine_driver import make_batch, run_to_end, warm_engine
from tests.vision_fixtures import image_bytes
from tests.vlm_fallback_fixtures import PALIGEMMA_IMAGE_TOKENS, make_paligemma_folder, processed

NEW_TOKENS = 6
MODES = {"padded": True, "one request per forward": False}  # KETTLE_TUNING's fallback-padding
PROMPTS = ["<image>What is in", "<image>caption en"]  # one image each
TEXT_PROMPT = "The capital of France is"


@contextmanager
def fallback_padding(on: bool) -> Iterator[None]:
    """`KETTLE_TUNING=fallback-padding=` inside the block (the runner reads it when it is built)."""
    before = os.environ.get(settings.TUNING_VARIABLE)
    os.environ[settings.TUNING_VARIABLE] = settings.merge_tuning(before, {"fallback-padding": on})
    getattr(settings.current, "cache_clear", lambda: None)()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(settings.TUNING_VARIABLE)
        else:
            os.environ[settings.TUNING_VARIABLE] = before
        getattr(settings.current, "cache_clear", lambda: None)()


@pytest.fixture(scope="module")
def paligemma(tmp_path_factory):
    folder = make_paligemma_folder(tmp_path_factory.mktemp("paligemma"))
    return folder, AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=list(MODES))
def family(request, paligemma):
    folder, reference = paligemma
    with fallback_padding(MODES[request.param]):
        engine, info = warm_engine(folder)
    return dict(type="paligemma", folder=folder, engine=engine, info=info, reference=reference,
                count=PALIGEMMA_IMAGE_TOKENS, prompts=PROMPTS, padded=MODES[request.param])  # fmt: skip


def image_case(family, text: str, data: bytes):
    """(prompt ids, its pb.Image as the router sends it, transformers' greedy tokens with the image, without it)."""
    inputs = processed(family["folder"], text, [data])
    ids = inputs["input_ids"][0].tolist()
    start = ids.index(family["reference"].config.image_token_id)
    image = pb.Image(data=data, digest=hashlib.blake2b(data, digest_size=16).digest(), start=start)
    image.length = family["count"]
    plain = {k: inputs[k] for k in ("input_ids", "attention_mask")}
    return ids, image, greedy(family["reference"], inputs), greedy(family["reference"], plain)


def greedy(model, inputs: dict) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_served_through_transformers_and_taking_images(family):
    engine, info = family["engine"], family["info"]
    assert family["type"] not in ARCHITECTURES  # if a native family lands, pick another type for these tests
    assert info.execution_path == "transformers" and info.takes_images and info.requires_padding
    assert isinstance(engine.runner, FallbackRunner) and engine.runner.images is not None
    assert engine.runner.padding == family["padded"]
    assert engine.runner.model.position_offset == 1  # PaliGemma counts positions from 1


def test_a_prompt_with_an_image_answers_as_transformers(family):
    ids, image, expected, without = image_case(family, family["prompts"][0], image_bytes("PNG", (40, 30), seed=1))
    assert expected != without  # the image matters to the answer
    batch = make_batch(1, [ids], first_id=10, max_new_tokens=NEW_TOKENS)
    batch.requests[0].images.append(image)
    assert run_to_end(family["engine"], batch)[10] == expected
    assert not family["engine"].runner._own and family["engine"].runner._padded is None


def test_image_and_text_requests_in_one_batch(family):
    """Two prompts with different images and lengths around a text prompt: each answer is transformers' alone."""
    first = image_case(family, family["prompts"][0], image_bytes("PNG", (40, 30), seed=2))
    second = image_case(family, family["prompts"][1], image_bytes("JPEG", (20, 64), seed=3))
    text = AutoTokenizer.from_pretrained(family["folder"])(TEXT_PROMPT, return_tensors="pt")
    text_ids = text["input_ids"][0].tolist()
    batch = make_batch(2, [first[0], text_ids, second[0]], first_id=20, max_new_tokens=NEW_TOKENS)
    batch.requests[0].images.append(first[1])
    batch.requests[2].images.append(second[1])
    tokens = run_to_end(family["engine"], batch)
    assert tokens[20] == first[2]
    assert tokens[21] == greedy(family["reference"], dict(text))
    assert tokens[22] == second[2]


def test_a_prompt_sent_in_chunks_that_end_inside_its_image(family):
    """The router's chunks of 3 tokens cut the image's run: the shard computes the prompt whole with its last."""
    ids, image, expected, _ = image_case(family, family["prompts"][1], image_bytes("PNG", (48, 48), seed=4))
    assert any(image.start < end < image.start + image.length for end in range(3, len(ids), 3))
    batch = make_batch(3, [ids], first_id=30, max_new_tokens=NEW_TOKENS, chunk_len=3)
    batch.requests[0].images.append(image)
    assert run_to_end(family["engine"], batch)[30] == expected


def test_prompt_logprobs_read_the_image_as_transformers_does(family):
    """Every prompt position's logprob, image tokens included (PaliGemma attends both ways over its prompt: its token
    types reach the forward), as transformers' forward with the processor's inputs gives them."""
    text, data = family["prompts"][1], image_bytes("PNG", (40, 30), seed=6)
    ids, image, _, _ = image_case(family, text, data)
    batch = make_batch(4, [ids], first_id=40, max_new_tokens=1, prefill_logprobs=True)
    batch.requests[0].images.append(image)
    generation = family["engine"].prefill(pb.PrefillRequest(batch=batch)).generations[0]
    with torch.no_grad():
        logits = family["reference"](**processed(family["folder"], text, [data])).logits[0]
    expected = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(list(generation.prefill_tokens.logprobs)[1:]), expected, atol=1e-4, rtol=0)


def test_a_text_only_fallback_model_takes_no_images(tmp_path):
    from tests.models.fallback_helpers import make_tiny_gpt_neo

    engine, info = warm_engine(make_tiny_gpt_neo(tmp_path))
    assert info.execution_path == "transformers" and not info.takes_images and engine.runner.images is None
