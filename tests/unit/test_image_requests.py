"""Requests with images through the real routes and validation of a model that takes images (a tiny LLaVA's
tokenizer and processor files), over the fake Infer of test_http_api: the image tokens in the prompt's ids and in
`usage`, every limit's 422 on both APIs, the images reaching the shard's proto and the prefix cache's key."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from kettle.router.app import create_app
from kettle.router.config import RouterConfig
from kettle.router.prefix_cache import PrefixCachingAllocator, block_hashes
from kettle.router.queue import Entry
from kettle.router.schemas import GenerateRequest
from kettle.router.server import image_reader
from kettle.router.tokenizer import TokenizerPool
from kettle.router.validation import Validation, ValidationLimits
from tests.unit.test_http_api import INFO, FakeInfer
from tests.vision_fixtures import LLAVA_IMAGE_TOKENS, data_url, image_bytes, make_llava_folder

LIMITS = ValidationLimits(2, 4, 5, max_input_tokens=96, max_total_tokens=128)
N = LLAVA_IMAGE_TOKENS


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_llava_folder(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def pool(folder):
    pool = TokenizerPool.from_path(str(folder), 1)
    yield pool
    pool.close()


@pytest.fixture
def make_client(folder, pool):
    def make(infer: FakeInfer, **flags) -> TestClient:
        config = RouterConfig(master_shard_uds_path="/tmp/none", tokenizer_name=str(folder), model_id="llava", **flags)
        validation = Validation(LIMITS, pool, images=image_reader(config))
        return TestClient(create_app(config, infer, validation, INFO, LIMITS))

    return make


def chat(*parts, max_tokens=3) -> dict:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_a_chat_image_becomes_its_image_tokens_and_counts_in_usage(make_client, folder):
    infer = FakeInfer()
    png = image_bytes("PNG", (40, 30))
    response = make_client(infer).post("/v1/chat/completions", json=chat("What is this?", image_part(data_url(png))))
    assert response.status_code == 200, response.text
    (request,) = infer.requests
    image_id = request.input_ids[request.images[0].start]
    assert request.input_ids.count(image_id) == N and request.images[0].length == N
    assert request.input_ids[request.images[0].start : request.images[0].start + N] == (image_id,) * N
    assert request.images[0].data == png
    assert response.json()["usage"]["prompt_tokens"] == request.input_length > N
    client = make_client(FakeInfer())
    assert client.get("/info").json()["model_pipeline_tag"] == "image-text-to-text"
    assert client.get("/v1/models").json()["data"][0]["input_modalities"] == ["text", "image"]


def test_a_markdown_image_in_generate_inputs(make_client):
    infer = FakeInfer()
    url = data_url(image_bytes("JPEG", (50, 50)), "image/jpeg")
    body = {"inputs": f"Describe ![]({url}) please", "parameters": {"max_new_tokens": 2}}
    response = make_client(infer).post("/generate", json=body)
    assert response.status_code == 200, response.text
    (request,) = infer.requests
    assert len(request.images) == 1 and request.images[0].length == N
    assert url not in request.inputs and "<image>" * N in request.inputs
    # The shard's view carries the image, and its digest keys the prefix cache.
    entry = Entry(1, request)
    entry.allocation = PrefixCachingAllocator(16, 16).allocate(request.input_length + 2)
    proto = entry.to_proto()
    assert [(i.start, i.length, i.digest) for i in proto.images] == [
        (request.images[0].start, N, request.images[0].digest)
    ]


@pytest.mark.parametrize(
    ("parts", "flags", "message"),
    [
        ([image_part(data_url(image_bytes()))] * 3, {}, "a request may carry at most 2 images. Given: 3"),
        (
            [image_part(data_url(image_bytes()))],
            {"max_image_bytes": 10},
            "image 0 is larger than the limit of 10 bytes",
        ),
        ([image_part(data_url(image_bytes(size=(20, 20))))], {"max_image_pixels": 399}, "image 0 has more than 399"),
        ([image_part(data_url(image_bytes("BMP")))], {}, "image 0 is BMP, not a format this server reads"),
        ([image_part("http://127.0.0.1:9/x.png")], {"disable_image_fetch": True}, "image 0: this server does not"),
        ([image_part("file:///etc/passwd")], {}, "image 0: only data:, http: and https: URLs are read"),
        ([{"type": "input_audio", "input_audio": {}}], {}, "content parts of type `input_audio` are not supported"),
    ],
)
def test_every_image_limit_is_a_422_before_queueing(make_client, parts, flags, message):
    infer = FakeInfer()
    limits = {"max_images_per_request": 2} | flags
    response = make_client(infer, **limits).post("/v1/chat/completions", json=chat("Look:", *parts))
    assert response.status_code == 422 and response.json()["error_type"] == "validation", response.text
    assert response.json()["error"].startswith("Input validation error: " + message)
    assert not infer.requests


def test_image_tokens_count_against_max_input_tokens(make_client):
    """The text alone fits under --max-input-tokens (96); with two images of 16 tokens it does not."""
    images = [image_part(data_url(image_bytes(seed=i))) for i in range(2)]
    client, infer = make_client(FakeInfer(), max_images_per_request=2), FakeInfer()
    text = "Hello world! " * 16
    assert make_client(infer).post("/v1/chat/completions", json=chat(text)).status_code == 200
    alone = infer.requests[0].input_length
    assert 96 - 2 * N < alone <= 96 and alone + 2 * N + 3 <= 128
    response = client.post("/v1/chat/completions", json=chat(text, *images))
    assert response.status_code == 422
    given = alone + 2 * N
    assert response.json()["error"] == f"Input validation error: `inputs` must have less than 96 tokens. Given: {given}"


def test_the_prefix_cache_keys_image_tokens_by_the_image():
    ids = [1, 2, 3, 4] + [9] * 8 + [5, 6, 7, 8]
    first, second = b"a" * 16, b"b" * 16
    one, other = block_hashes(ids, 4, images=[(4, first)]), block_hashes(ids, 4, images=[(4, second)])
    assert one[0] == other[0] and one[1] != other[1] and one[3] != other[3]  # text before the image is shared
    assert block_hashes(ids, 4, images=[(4, first)]) == one
    cache = PrefixCachingAllocator(16, 4)
    held = cache.allocate(len(ids) + 1, ids, images=[(4, first)])
    cache.commit(held)
    assert cache.allocate(len(ids) + 1, ids, images=[(4, first)]).cache_len == 12  # the same image: a hit
    assert cache.allocate(len(ids) + 1, ids, images=[(4, second)]).cache_len == 4  # another: only the text before


def test_a_text_model_keeps_markdown_as_text(pool):
    validation = Validation(LIMITS, pool)  # no image reader: a text model
    inputs = "See ![](http://127.0.0.1:9/x.png)"
    valid = asyncio.run(validation.validate(GenerateRequest(inputs=inputs, parameters={"max_new_tokens": 2})))
    assert valid.inputs == inputs and valid.images == ()


def test_truncation_into_an_image_is_refused(make_client):
    """`truncate` keeps the prompt's last tokens: cutting into an image's tokens would leave rows without it."""
    url = data_url(image_bytes())
    body = {"inputs": f"Describe ![]({url}) please", "parameters": {"max_new_tokens": 2, "truncate": 10}}
    response = make_client(FakeInfer()).post("/generate", json=body)
    assert response.status_code == 422
    assert response.json()["error"] == (
        "Input validation error: the prompt's image tokens do not match its images (truncated into an image?)"
    )
    body["parameters"]["truncate"] = 60  # the whole prompt: nothing cut
    assert make_client(FakeInfer()).post("/generate", json=body).status_code == 200
