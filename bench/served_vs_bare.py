"""Single-stream decode over HTTP against the bare decode step, alternated in one run.

    .venv/bin/python bench/served_vs_bare.py                       # bundled model, `make serve`'s defaults
    .venv/bin/python bench/served_vs_bare.py --rounds 3 --max-new-tokens 64

Method: one server started as `make serve` starts it (no flags, its own subprocesses), and in this process the
same model folder loaded as a shard loads it (default scheme and KV cache dtype). Each round streams
kettle.bench.loadgen's chat prompts to the server one after another (decode tok/s: the tokens after each
stream's first over the time from its first token to its last, summed over the streams; the gaps between
requests, prefills and connection set-up, are left out as the bare step has none), then runs the bare step:
`--max-new-tokens` greedy decode steps of one sequence after a prompt of the same length as the served ones
(metadata build + forward + logits + argmax, as bench/model_decode.py times it), tok/s = steps / their time.
The two never run at once (the idle side sleeps), and each round's ratio served / bare is printed with the
median over the rounds: the target is within 10% (a ratio of 0.9 or more).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch
from model_decode import kettle_decode

from kettle.bench.loadgen import chat_prompts, run_load
from kettle.bench.process import KettleServer
from kettle.hub import resolve_model
from kettle.models.registry import load_model


def bare_decode(model, prompt_tokens: int, steps: int) -> float:
    """tok/s of `steps` greedy one-sequence decode steps after a `prompt_tokens` prompt, on a fresh cache (in the
    shard's default KV dtype), as bench/model_decode.py runs them."""
    step = kettle_decode(model, 1, prompt_tokens, steps)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps / (time.perf_counter() - start)


def stream_decode_rate(results) -> float:
    """Tokens after each stream's first over the sum of the streams' first-to-last-token spans."""
    streams = [s for result in results for s in result.streams]
    return sum(len(s.arrivals) - 1 for s in streams) / sum(s.arrivals[-1] - s.arrivals[0] for s in streams)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="the bare step's threads (the shard's default: all)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(None).path
    prompts = chat_prompts(path)[:3]
    model = load_model(path, torch.float32, "cpu")
    prompt_tokens = 48  # about the chat prompts' rendered length
    server = KettleServer(None)
    ratios = []
    try:
        asyncio.run(run_load(server.url, prompts[:1], 1, 16))  # warm-up: the first request's one-off costs
        bare_decode(model, prompt_tokens, 16)
        for r in range(args.rounds):
            # One prompt after another: a single stream at a time (run_load with one stream takes the first only).
            loads = [asyncio.run(run_load(server.url, [prompt], 1, args.max_new_tokens)) for prompt in prompts]
            served = stream_decode_rate(loads)
            bare = bare_decode(model, prompt_tokens, args.max_new_tokens)
            ratios.append(served / bare)
            print(f"round {r + 1}: served {served:.1f} tok/s, bare {bare:.1f}, ratio {ratios[-1]:.2f}", flush=True)
    finally:
        server.stop()
    print(f"median ratio served / bare: {statistics.median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()
