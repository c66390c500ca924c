"""Multi-LoRA over HTTP: a server started with `--lora-adapters` answers each adapter's requests with the tokens
transformers + peft generate, in one batch with the base model's, through the TGI and OpenAI routes."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kettle.bench.process import KettleServer
from tests.e2e.kv_pool import assert_pool_whole
from tests.models.test_lora import ALL_MODULES, make_adapter

PROMPT = "The capital of France is"
NEW = 12


@pytest.fixture(scope="module")
def adapters(tiny_llama_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e-adapters")
    return {
        "alpha": make_adapter(tiny_llama_path, root / "alpha", 4, ALL_MODULES, seed=3),
        "beta": make_adapter(tiny_llama_path, root / "beta", 8, ["q_proj", "v_proj", "up_proj"], seed=4),
    }


@pytest.fixture(scope="module")
def lora_server(tiny_llama_path, adapters):
    value = ",".join(f"{name}={path}" for name, path in adapters.items())
    server = KettleServer(str(tiny_llama_path), "--lora-adapters", value, "--max-total-tokens", "128")
    yield server
    try:
        assert_pool_whole(server.url)
    finally:
        server.stop()


def peft_greedy(base, adapter) -> list[int]:
    from peft import PeftModel

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, attention_mask=torch.ones_like(ids))
    return out[0, ids.shape[1] :].tolist()


def test_each_adapter_matches_peft_in_one_mixed_batch(lora_server, tiny_llama_path, adapters):
    async def ask(client, adapter):
        parameters = {"max_new_tokens": NEW, "details": True, **({"adapter_id": adapter} if adapter else {})}
        response = await client.post("/generate", json={"inputs": PROMPT, "parameters": parameters}, timeout=60)
        assert response.status_code == 200, response.text
        return [t["id"] for t in response.json()["details"]["tokens"]]

    async def main():
        async with httpx.AsyncClient(base_url=lora_server.url) as client:
            return await asyncio.gather(*(ask(client, a) for a in ["alpha", None, "beta", "alpha"]))

    alpha, base, beta, alpha_again = asyncio.run(main())
    expected = {name: peft_greedy(tiny_llama_path, adapters.get(name)) for name in ("alpha", "beta", None)}
    assert alpha == alpha_again == expected["alpha"][: len(alpha)]
    assert beta == expected["beta"][: len(beta)]
    assert base == expected[None][: len(base)]
    assert alpha != base


def test_openai_routes_pick_the_adapter_by_model_and_list_it(lora_server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{lora_server.url}/v1", api_key="-")
    assert [m.id for m in client.models.list().data][1:] == ["alpha", "beta"]
    chat = client.chat.completions.create(model="beta", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.choices[0].message.content is not None
    metrics = httpx.get(f"{lora_server.url}/metrics").text
    assert 'kettle_lora_requests_total{adapter="beta"}' in metrics
    unknown = httpx.post(
        f"{lora_server.url}/generate", json={"inputs": "Hi", "parameters": {"adapter_id": "gamma"}}, timeout=60
    )
    assert unknown.status_code == 422 and "`alpha`, `beta`" in unknown.json()["error"]
