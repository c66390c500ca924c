"""Decode tokens/s with 1 shard and with N tensor-parallel shards, through the real launcher and HTTP streams.

    .venv/bin/python bench/tensor_parallel.py                    # bundled model, 1 vs 2 shards, 1 and 4 streams
    .venv/bin/python bench/tensor_parallel.py --shards 1,2 --streams 1,4 --max-new-tokens 64

Each configuration is served in turn (same prompts, greedy), so the ratios come from one run. On a CPU the
shards split the cores (`--num-threads` defaults to cores / shards) and exchange activations over gloo twice
per layer, so this measures the overhead of tensor parallelism there, not a speed-up; on several GPUs each
rank reads only its share of the weights per step.
"""

from __future__ import annotations

import argparse
import asyncio

from compare import chat_prompts  # bench/ is the script's folder

from kettle.bench.loadgen import run_load
from kettle.bench.process import KettleServer, free_port


def measure(model_path: str, shards: int, streams: list[int], max_new_tokens: int) -> dict[int, dict[str, float]]:
    """Summaries of a load run per concurrency, on a server with `shards` shards."""
    server = KettleServer(model_path, "--num-shard", str(shards), "--master-port", str(free_port()))
    try:
        prompts = chat_prompts(model_path)
        asyncio.run(run_load(server.url, prompts, 2, 8))  # warm the first-call paths
        return {c: asyncio.run(run_load(server.url, prompts, c, max_new_tokens)).summary() for c in streams}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default=None, help="model to serve (default: the bundled SmolLM2)")
    parser.add_argument("--shards", default="1,2", help="shard counts, comma-separated")
    parser.add_argument("--streams", default="1,4")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    from kettle.hub import resolve_model

    model_path = str(resolve_model(args.model_id).path)
    streams = [int(x) for x in args.streams.split(",")]
    results = {n: measure(model_path, n, streams, args.max_new_tokens) for n in map(int, args.shards.split(","))}
    base = results[min(results)]
    print(f"\nmodel: {model_path}\nmax_new_tokens={args.max_new_tokens}, greedy\n")
    print("| shards | streams | decode tok/s | ITL p50 ms | vs 1st row's shards |")
    print("|---|---|---|---|---|")
    for n, rows in results.items():
        for c, s in rows.items():
            ratio = s["decode tok/s"] / base[c]["decode tok/s"]
            print(f"| {n} | {c} | {s['decode tok/s']:.1f} | {s['itl p50'] * 1000:.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
