"""The whole server on a GPU: `kettle launch` (launcher → shard on CUDA → router) over HTTP, in bf16, with
`--quantize int4` and with a float8 KV cache, driven like a client would: /generate, /generate_stream, OpenAI
chat (plain and streamed), seeded sampling with top tokens, and a concurrent batch that replays the decode CUDA
graphs.

Skipped without a CUDA device. Without the `kettle` console script next to the interpreter (a device with
the package on PYTHONPATH only), a wrapper runs `python -m kettle.cli` instead.
"""

from __future__ import annotations

import asyncio
import json
import stat
import sys
from pathlib import Path

import httpx
import pytest
import torch

from kettle.bench import process
from kettle.bench.process import KettleServer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = ["The capital of France is", "Hello", "def add(a, b):\n    return", "你好，世界！", "Numbers 0 1 2 3"]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def kettle_command(folder: Path) -> str:
    """The `kettle` script beside the interpreter, else a wrapper around `python -m kettle.cli`."""
    if Path(process.KETTLE).exists():
        return process.KETTLE
    wrapper = folder / "kettle"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m kettle.cli "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return str(wrapper)


SERVERS = {"bf16": (), "int4": ("--quantize", "int4"), "fp8-kv": ("--kv-cache-dtype", "fp8_e4m3fn")}


@pytest.fixture(scope="module", params=list(SERVERS.values()), ids=list(SERVERS))
def gpu_server(request, tiny_llama_path, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(process, "KETTLE", kettle_command(tmp_path_factory.mktemp("bin")))
        server = KettleServer(
            str(tiny_llama_path),
            "--max-concurrent-requests",
            "16",
            "--max-input-tokens",
            "200",
            "--max-total-tokens",
            "256",
            *request.param,
            timeout=600,
        )
    yield server
    code = server.stop()
    assert code == 0, f"launcher exited with {code}:\n{server.logs()}"


def generate(url: str, inputs: str, **parameters) -> httpx.Response:
    return httpx.post(f"{url}/generate", json={"inputs": inputs, "parameters": parameters}, timeout=120)


def complete(text: str) -> str:
    """The text without a trailing replacement character: a generation cut inside a multi-byte character ends
    with one in the final text, while the stream withholds the incomplete bytes (random weights do this)."""
    return text.rstrip("\ufffd")


def test_info_reports_the_gpu(gpu_server):
    info = httpx.get(f"{gpu_server.url}/info", timeout=10).json()
    assert info["model_device_type"] == "cuda" and info["model_dtype"] == "bfloat16"
    fp8_kv = "--kv-cache-dtype" in gpu_server.flags
    assert info["kv_cache_dtype"] == ("float8_e4m3fn" if fp8_kv else "bfloat16")
    assert info["cpu_kernels"] is None  # a GPU shard runs none of the CPU kernels


def test_greedy_generate_is_deterministic(gpu_server):
    first = generate(gpu_server.url, PROMPTS[0], max_new_tokens=16, details=True)
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["details"]["generated_tokens"] == len(body["details"]["tokens"]) > 0
    assert body["details"]["finish_reason"] in ("length", "eos_token")
    again = generate(gpu_server.url, PROMPTS[0], max_new_tokens=16, details=True).json()
    assert [t["id"] for t in again["details"]["tokens"]] == [t["id"] for t in body["details"]["tokens"]]


def test_concurrent_batch_all_answer(gpu_server):
    async def run_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as client:
            body = {"parameters": {"max_new_tokens": 24, "details": True}}
            return await asyncio.gather(
                *(client.post(f"{gpu_server.url}/generate", json={"inputs": p, **body}) for p in PROMPTS * 3)
            )

    for response in asyncio.run(run_all()):
        assert response.status_code == 200, response.text
        assert response.json()["details"]["generated_tokens"] > 0


def test_stream_concatenates_to_generated_text(gpu_server):
    body = {"inputs": PROMPTS[3], "parameters": {"max_new_tokens": 12, "details": True}}
    with httpx.stream("POST", f"{gpu_server.url}/generate_stream", json=body, timeout=120) as response:
        assert response.status_code == 200
        events = [json.loads(line.removeprefix("data:")) for line in response.iter_lines() if line]
    last = events[-1]
    assert last["details"]["generated_tokens"] == len(events)
    text = "".join(e["token"]["text"] for e in events if not e["token"]["special"])
    assert text == complete(last["generated_text"])


def test_seeded_sampling_with_top_tokens(gpu_server):
    """Temperature + top-p sampling and top_n_tokens: the step's single device→host transfer carries them."""
    params = {"max_new_tokens": 8, "do_sample": True, "seed": 7, "temperature": 0.8, "top_p": 0.9}
    params |= {"top_n_tokens": 3, "details": True}
    first = generate(gpu_server.url, PROMPTS[1], **params)
    assert first.status_code == 200, first.text
    details = first.json()["details"]
    assert len(details["top_tokens"]) == details["generated_tokens"]
    assert all(len(step) >= 1 for step in details["top_tokens"])  # top-p may leave fewer than 3 candidates
    assert all(step[0]["logprob"] >= step[-1]["logprob"] for step in details["top_tokens"])
    assert generate(gpu_server.url, PROMPTS[1], **params).json()["generated_text"] == first.json()["generated_text"]


def test_openai_chat_plain_and_streamed(gpu_server):
    url = f"{gpu_server.url}/v1/chat/completions"
    body = {"model": "tgi", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    answer = httpx.post(url, json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    whole = answer.json()
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"]["role"] == "assistant"
    assert whole["usage"]["completion_tokens"] > 0
    with httpx.stream("POST", url, json=body | {"stream": True}, timeout=120) as response:
        assert response.status_code == 200
        lines = [line.removeprefix("data:").strip() for line in response.iter_lines() if line]
    chunks = [json.loads(line) for line in lines if line != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == complete(whole["choices"][0]["message"]["content"])
