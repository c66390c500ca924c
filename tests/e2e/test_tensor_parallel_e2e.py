"""Tensor parallelism end to end: the real launcher with `--num-shard 2` (two gloo ranks on the CPU).

Two shards must generate exactly the greedy tokens of one shard (plain and streamed, in one concurrent batch)
for the tiny Llama, served here as two "nodes" (two launchers with --nnodes 2 on this machine, one rank each),
and transformers' greedy tokens for a multi-query GPT-BigCode with tied embeddings (its single KV head
replicated on both ranks) served by one launcher with --num-shard 2; killing one rank in the middle of a
generation must stop the whole server with a non-zero exit within 30 seconds, never hang.
(tests/unit/test_parallel_layers.py covers a tied Llama with one KV head and an uneven head split.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kettle.bench.process import KETTLE, KettleServer, free_port
from kettle.settings import merge_tuning
from tests.e2e.test_generate_e2e import PROMPTS, stream_events
from tests.models.family_parity import save_tiny, tiny_settings

# gloo on the CPU: with CUDA the shards would run NCCL, which needs a GPU per rank (and a GPU reference).
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (gloo) tensor-parallel test")
LIMITS = ("--max-input-tokens", "200", "--max-total-tokens", "256", "--max-concurrent-requests", "32")
NEW_TOKENS = 16


def sharded_server(model_path, *flags: str) -> KettleServer:
    return KettleServer(str(model_path), "--num-shard", "2", "--master-port", str(free_port()), *LIMITS, *flags)


def generate_all(url: str, prompts: list[str]) -> dict[str, list[int]]:
    """Greedy token ids of every prompt, all sent at once (so they share batches on the server)."""

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"parameters": {"max_new_tokens": NEW_TOKENS, "details": True}}
            calls = [client.post(f"{url}/generate", json={"inputs": p, **body}) for p in prompts]
            return await asyncio.gather(*calls)

    out = {}
    for prompt, response in zip(prompts, asyncio.run(run()), strict=True):
        assert response.status_code == 200, response.text
        out[prompt] = [token["id"] for token in response.json()["details"]["tokens"]]
    return out


def prime(url: str) -> None:
    """Uses up request id 0 with a throwaway request. The shard reuses its batch sampler when a batch has the
    same request ids as the previous one, and the warmup batch's ids start at 0 too: a first batch of
    requests 0 and 1 would sample with the warmup's parameters (a runner bug outside tensor parallelism, which
    would make either server's first answers wrong)."""
    response = httpx.post(f"{url}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 1}}, timeout=60)
    assert response.status_code == 200, response.text


def streamed_ids(url: str, prompt: str) -> list[int]:
    events = stream_events(url, prompt, max_new_tokens=NEW_TOKENS)
    assert events[-1]["generated_text"] is not None
    return [event["token"]["id"] for event in events]


def shard_pids(server: KettleServer) -> dict[int, int]:
    """rank → pid of the launcher's shard processes."""
    pids = {}
    for child in psutil.Process(server.process.pid).children(recursive=True):
        argv = child.cmdline()
        if "serve" in argv and "--rank" in argv:
            pids[int(argv[argv.index("--rank") + 1])] = child.pid
    return pids


@pytest.fixture(scope="module")
def two_shards(tiny_llama_path):
    """The tiny Llama on 2 ranks started by two launchers (--nnodes 2): node 1 runs rank 1 only, node 0 runs
    rank 0 and the router, which finds rank 1 through rank 0's service discovery."""
    uds, port = os.path.join(tempfile.mkdtemp(prefix="kettle-nodes-"), "shard"), str(free_port())
    flags = ["--model-id", str(tiny_llama_path), "--num-shard", "1", "--nnodes", "2", "--master-port", port]
    log = tempfile.NamedTemporaryFile(prefix="kettle-node1-", suffix=".log", delete=False)  # noqa: SIM115
    env = {**os.environ, "KETTLE_TUNING": merge_tuning(os.environ.get("KETTLE_TUNING"), {"max-kv-tokens": 65536})}
    node1 = subprocess.Popen(
        [KETTLE, "launch", *flags, "--node-rank", "1", "--shard-uds-path", uds, *LIMITS],
        stdout=log,
        stderr=log,
        env=env,
    )
    try:
        # The later --shard-uds-path wins: both nodes must name the same socket paths on one machine.
        server = KettleServer(None, *flags[2:], "--model-id", str(tiny_llama_path), "--shard-uds-path", uds, *LIMITS)
    except Exception:
        node1.kill()
        raise
    server.node1 = node1
    prime(server.url)
    yield server
    code = server.stop()
    node1.send_signal(signal.SIGTERM)
    assert node1.wait(30) == 0, Path(log.name).read_text()[-3000:]
    assert code == 0, f"launcher exited with {code}:\n{server.logs()}"


def make_tiny_bigcode(path):
    """A 2-layer multi-query GPT-BigCode (one KV head) with tied embeddings and the tiny tokenizer."""
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    settings = tiny_settings(path)
    config = GPTBigCodeConfig(
        n_embd=settings["hidden_size"], n_layer=2, n_head=settings["num_attention_heads"],
        n_inner=settings["intermediate_size"], n_positions=settings["max_position_embeddings"],
        vocab_size=settings["vocab_size"], initializer_range=settings["initializer_range"],
        eos_token_id=settings["eos_token_id"], bos_token_id=settings["eos_token_id"],
        multi_query=True, tie_word_embeddings=True,
    )  # fmt: skip
    return save_tiny(path, config, GPTBigCodeForCausalLM)


@pytest.fixture(scope="module")
def multi_query(tmp_path_factory):
    """The tiny multi-query GPT-BigCode served by 2 shards."""
    path = make_tiny_bigcode(tmp_path_factory.mktemp("bigcode-mq"))
    server = sharded_server(path)
    prime(server.url)
    yield path, server
    server.stop()  # the last test kills a rank: the exit code is that test's business


def test_each_node_runs_its_own_rank(two_shards):
    assert list(shard_pids(two_shards)) == [0]
    node1 = psutil.Process(two_shards.node1.pid).children(recursive=True)
    assert [c.cmdline()[c.cmdline().index("--rank") + 1] for c in node1 if "--rank" in c.cmdline()] == ["1"]
    assert not [c for c in node1 if "router" in c.cmdline()], "only node 0 runs a router"


def test_two_shards_generate_the_tokens_of_one(tiny_server, two_shards):
    prime(tiny_server.url)
    assert generate_all(two_shards.url, PROMPTS) == generate_all(tiny_server.url, PROMPTS)


def test_two_shards_stream_the_tokens_of_one(tiny_server, two_shards):
    for prompt in PROMPTS[:3]:
        assert streamed_ids(two_shards.url, prompt) == streamed_ids(tiny_server.url, prompt)


def test_seeded_sampling_is_reproducible_across_requests(two_shards):
    body = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 8, "do_sample": True, "seed": 11, "details": True}}
    runs = [httpx.post(f"{two_shards.url}/generate", json=body, timeout=60).json() for _ in range(2)]
    assert runs[0]["generated_text"] == runs[1]["generated_text"]


def test_multi_query_family_with_tied_embeddings_matches_transformers(multi_query):
    path, server = multi_query
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, attention_mask=torch.ones_like(ids))
        expected[prompt] = out[0, ids.shape[1] :].tolist()
    got = generate_all(server.url, PROMPTS)
    assert got == {prompt: expected[prompt][: len(got[prompt])] for prompt in PROMPTS}
    assert streamed_ids(server.url, PROMPTS[0]) == got[PROMPTS[0]]


def test_a_rank_killed_mid_generation_stops_the_launcher(multi_query):
    _path, server = multi_query
    children = psutil.Process(server.process.pid).children(recursive=True)
    first_token = threading.Event()

    def stream(prompt: str) -> None:
        body = {"inputs": prompt, "parameters": {"max_new_tokens": 200}}
        try:
            with httpx.stream("POST", f"{server.url}/generate_stream", json=body, timeout=60) as response:
                for _line in response.iter_lines():
                    first_token.set()
        except httpx.HTTPError:
            pass  # the server going away mid-stream is expected
        first_token.set()

    for prompt in PROMPTS[:4]:  # several streams: some are surely still generating when the rank dies
        threading.Thread(target=stream, args=(prompt,), daemon=True).start()
    assert first_token.wait(60)
    started = time.monotonic()
    os.kill(shard_pids(server)[1], signal.SIGKILL)
    code = server.process.wait(30)
    assert code != 0
    assert time.monotonic() - started < 30
    logs = Path(server.log.name).read_text(errors="replace")  # all of it: tracebacks can push the line out
    assert "shard-1 was killed by SIGKILL" in logs or "a peer shard is gone" in logs, logs[-6000:]
    gone = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not gone, f"orphans left: {[c.cmdline() for c in gone]}"
