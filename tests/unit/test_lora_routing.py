"""LoRA on the router: `adapter_id` and OpenAI's `model` pick an adapter, unknown ones get a 422 naming the
loaded ones, /v1/models lists them, and the prefix cache never shares K/V across adapters."""

from __future__ import annotations

from dataclasses import replace

from kettle.router.prefix_cache import PrefixCachingAllocator
from kettle.router.queue import Entry, Queue
from tests.unit.fake_client import make_request
from tests.unit.test_http_api import FakeInfer
from tests.unit.test_openai_api import USER, make_client, model_folder, validation  # noqa: F401

ADAPTERS = ("customer-a", "customer-b")


def test_adapter_id_reaches_the_request_and_unknown_ones_are_refused(make_client):  # noqa: F811
    infer = FakeInfer()
    client = make_client(infer, adapters=ADAPTERS)
    ok = client.post("/generate", json={"inputs": "Hi", "parameters": {"adapter_id": "customer-b"}})
    assert ok.status_code == 200 and infer.requests[-1].adapter_id == "customer-b"
    assert client.post("/generate", json={"inputs": "Hi"}).status_code == 200
    assert infer.requests[-1].adapter_id is None
    unknown = client.post("/generate", json={"inputs": "Hi", "parameters": {"adapter_id": "nope"}})
    assert unknown.status_code == 422
    assert unknown.json()["error"] == (
        "Input validation error: adapter `nope` is not loaded (loaded adapters: `customer-a`, `customer-b`)"
    )


def test_openai_model_names_an_adapter_and_v1_models_lists_them(make_client):  # noqa: F811
    infer = FakeInfer()
    client = make_client(infer, adapters=ADAPTERS)
    assert client.post("/v1/chat/completions", json={"messages": USER, "model": "customer-a"}).status_code == 200
    assert infer.requests[-1].adapter_id == "customer-a"
    assert client.post("/v1/completions", json={"prompt": "a", "model": "tiny"}).status_code == 200
    assert infer.requests[-1].adapter_id is None  # the base model's name, or any other, is the base model
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert ids == ["tiny", *ADAPTERS]


def test_the_prefix_cache_does_not_share_blocks_across_adapters():
    allocator = PrefixCachingAllocator(64, 4)
    prompt = tuple(range(100, 117))  # four full blocks and one token
    first = allocator.allocate(20, prompt, namespace="customer-a")
    allocator.commit(first)
    allocator.free(first)
    assert allocator.allocate(20, prompt, namespace="customer-b").cache_len == 0
    assert allocator.allocate(20, prompt).cache_len == 0  # the base model
    assert allocator.allocate(20, prompt, namespace="customer-a").cache_len == 16


def test_the_queue_allocates_under_the_request_adapter():
    allocator = PrefixCachingAllocator(64, 4)
    queue = Queue(allocator, 256, 256)
    request = make_request(input_len=13)
    seen = {}
    allocate = allocator.allocate

    def spy(n_tokens, prompt_ids=(), reuse=True, namespace="", images=()):
        seen["namespace"] = namespace
        return allocate(n_tokens, prompt_ids, reuse, namespace, images)

    allocator.allocate = spy
    queue.append(Entry(1, replace(request, adapter_id="customer-a")))
    batch = queue.next_batch(None, None, 256, 256)
    assert seen["namespace"] == "customer-a" and batch.batch.requests[0].adapter_id == "customer-a"
