"""The shard's resident memory apart from its KV cache: once ready, and after bursts of requests; llama.cpp's beside it.

    PYTHONPATH=. .venv/bin/python bench/shard_memory.py [--runs 2] [--bursts 3] [-- LAUNCH FLAGS...]

Each run starts `kettle launch` as `make serve` does (the bundled model, no flags), twice in turn: as it ships and
with KETTLE_RELEASE_LIBRARY_PAGES=0 (the library pages start-up ran kept resident). It reads the shard's VmRSS from
/proc minus its KV cache (the shard's `KV cache: ... MiB` line) when the shard has logged its memory, then after
each burst of 64 requests, 16 at a time (greedy and sampled, penalties, `top_n_tokens`, prompts of 10-200 tokens),
and after one burst of JSON-schema requests (the first grammar builds llguidance's tokenizer view), each read two
seconds after the burst, when the idle shard has handed freed memory back. llama.cpp (`llama_cpp.Llama`, n_ctx
8192, f16 KV cache) loads the same file and generates in a child process; its VmRSS minus its KV cache is the
comparable figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kettle.bench.process import KettleServer
from kettle.hub.resolve import bundled_gguf

MiB = 2**20
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
SENTENCE = "the kettle boils water for tea while the rain falls on the quiet town by the sea"
WORDS = SENTENCE.split()


def shard_rest(server: KettleServer) -> float:
    """The shard's VmRSS minus its KV cache, in MiB."""
    (shard,) = [p for p in psutil.Process(server.process.pid).children(recursive=True) if "serve" in p.cmdline()]
    kv = float(re.search(r"KV cache: .*?, ([0-9.]+) MiB\)", Path(server.log.name).read_text()).group(1))
    return shard.memory_info().rss / MiB - kv


def request(i: int, rng: random.Random, grammar: bool) -> dict:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 200)))
    parameters = {"max_new_tokens": 32, "details": True, "do_sample": i % 2 == 0, "seed": i}
    parameters |= {"repetition_penalty": 1.1} if i % 3 == 0 else {}
    parameters |= {"top_n_tokens": 3, "top_p": 0.9} if i % 4 == 0 else {}
    parameters |= {"grammar": {"type": "json", "value": SCHEMA}} if grammar else {}
    return {"inputs": prompt, "parameters": parameters}


async def burst(url: str, seed: int, grammar: bool = False, n: int = 64, concurrency: int = 16) -> None:
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def one(i: int) -> None:
            async with gate:
                (await client.post("/generate", json=request(i, rng, grammar))).raise_for_status()

        await asyncio.gather(*(one(i) for i in range(n)))


def kettle_run(release: bool, bursts: int, flags: list[str]) -> list[float]:
    server = KettleServer(None, *flags, env={"KETTLE_RELEASE_LIBRARY_PAGES": "1" if release else "0"})
    try:
        server.wait_for_log("Resident memory of shard-0")
        readings = [shard_rest(server)]
        for seed, grammar, n in [*((seed, False, 64) for seed in range(bursts)), (99, True, 16)]:
            asyncio.run(burst(server.url, seed, grammar, n))
            time.sleep(2)  # the idle shard hands freed memory back after a second
            readings.append(shard_rest(server))
    finally:
        server.stop()
    return readings


LLAMA_CPP = """
import json, sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=8192, n_threads=2, verbose=False)
for seed in range(3):
    llm("the kettle boils water for tea while the rain falls", max_tokens=32, seed=seed)
meta = llm.metadata
arch = meta["general.architecture"]
layers, width = int(meta[f"{arch}.block_count"]), int(meta[f"{arch}.embedding_length"])
heads = int(meta[f"{arch}.attention.head_count"])
kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
kv = llm.n_ctx() * layers * 2 * kv_heads * (width // heads) * 2  # K and V, float16
rss = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
print(json.dumps({"rss": rss, "kv": kv}))
"""


def llama_cpp_rest(model: str) -> tuple[float, float] | None:
    """llama.cpp's VmRSS and the part of it that is not its KV cache, in MiB; None where it is not installed."""
    try:
        out = subprocess.run([sys.executable, "-c", LLAMA_CPP, model], capture_output=True, text=True, check=True)
    except subprocess.CalledProcessError as error:
        print("llama.cpp not measured:", error.stderr.strip().splitlines()[-1:])
        return None
    answer = json.loads(out.stdout.splitlines()[-1])
    return answer["rss"] / MiB, (answer["rss"] - answer["kv"]) / MiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="starts of each setting, in turn")
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("flags", nargs="*", help="flags for `kettle launch` (after --)")
    args = parser.parse_args()
    labels = ["ready", *(f"burst {i + 1}" for i in range(args.bursts)), "grammar"]
    print("MiB apart from the KV cache:", " | ".join(labels))
    for run in range(args.runs):
        for release in (True, False):
            readings = kettle_run(release, args.bursts, args.flags)
            name = "library pages released" if release else "KETTLE_RELEASE_LIBRARY_PAGES=0"
            print(f"run {run + 1}, {name}:", " | ".join(f"{value:.1f}" for value in readings), flush=True)
        llama = llama_cpp_rest(str(bundled_gguf()))
        if llama is not None:
            rss, rest = llama
            print(f"run {run + 1}, llama.cpp (n_ctx 8192): VmRSS {rss:.1f}, apart from its KV cache {rest:.1f}")


if __name__ == "__main__":
    main()
