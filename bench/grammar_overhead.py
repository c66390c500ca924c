"""Decode tokens/s with and without a JSON-schema grammar, on the real server (bundled SmolLM2-135M by default).

    .venv/bin/python bench/grammar_overhead.py                        # 1 and 8 streams, 128 tokens, 3 rounds
    .venv/bin/python bench/grammar_overhead.py --streams 1,8 --rounds 5 --max-new-tokens 128

Method: one server; for each concurrency, rounds alternate an unconstrained run and a constrained run (same
prompts, greedy, `max_new_tokens` each), so machine noise hits both alike. The schema asks for at least 20
strings of 20+ characters, so constrained outputs run to `max_new_tokens` like the unconstrained ones. Decode
tok/s is loadgen's: tokens after each stream's first over the span from the first first-token to the last
token (prefill excluded). Prints medians and the constrained/unconstrained ratio (target: cost < 10%).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from kettle.bench.loadgen import LoadResult, chat_prompts, run_load
from kettle.bench.process import KettleServer
from kettle.hub import resolve_model

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "steps": {"type": "array", "items": {"type": "string", "minLength": 20, "maxLength": 120}, "minItems": 20},
    },
    "required": ["title", "steps"],
}


def measure(url: str, prompts: list[str], concurrency: int, rounds: int, max_new_tokens: int) -> list:
    """Median decode tok/s without and with the grammar, and the fewest tokens a stream got in each mode."""
    constrained = {"grammar": {"type": "json", "value": SCHEMA}}
    asyncio.run(run_load(url, prompts, concurrency, max_new_tokens, constrained))  # warm the grammar and first calls
    runs: dict[str, list[LoadResult]] = {"plain": [], "json": []}
    for _ in range(rounds):
        runs["plain"].append(asyncio.run(run_load(url, prompts, concurrency, max_new_tokens)))
        runs["json"].append(asyncio.run(run_load(url, prompts, concurrency, max_new_tokens, constrained)))
    speeds = [statistics.median(r.decode_tokens_per_s for r in runs[mode]) for mode in runs]
    fewest = [min(len(s.arrivals) for r in runs[mode] for s in r.streams) for mode in runs]
    return [*speeds, *fewest]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", default=None, help="default: the bundled model")
    parser.add_argument("--url", default=None, help="measure a running server instead of starting one")
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    model_path = str(resolve_model(args.model_id).path)
    # Chat-formatted requests for long answers: an instruct model stops at once on a bare prompt.
    prompts = [f"{p} Answer in JSON." for p in chat_prompts(model_path)]
    server = None if args.url else KettleServer(model_path, "--max-concurrent-requests", "64")
    url = args.url or server.url
    try:
        print("| streams | decode tok/s, no grammar | decode tok/s, JSON schema | ratio | fewest tokens/stream |")
        print("|---|---|---|---|---|")
        for concurrency in (int(s) for s in args.streams.split(",")):
            free, bound, few_free, few_bound = measure(url, prompts, concurrency, args.rounds, args.max_new_tokens)
            row = f"| {concurrency} | {free:.1f} | {bound:.1f} | {bound / free:.3f} | {few_free} / {few_bound} |"
            print(row, flush=True)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
