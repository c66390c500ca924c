"""Single-stream decode speed and start-up time of Kettle serving the bundled model, as `make serve` starts it.

Each configuration is a source tree (its kettle package on PYTHONPATH, e.g. an exported older commit for a
before/after comparison) plus launcher flags. All configurations are started (one after the other, each timed
to /health) and then served side by side: `--requests` rounds each send one streamed greedy generation of
`--max-new-tokens` tokens to every server in turn, so a busy shared machine loads them alike and each round
gives same-moment ratios. decode tok/s = tokens after the first over the time from the first token to the last;
medians printed, with each configuration's median ratio to the first one.

    PYTHONPATH=. .venv/bin/python bench/default_speed.py --tree before=/tmp/kettle-base --tree after=. \\
        --flags "" --flags "--quantize int4"

`--fresh-cache` gives every start an empty KETTLE_CACHE (first-start time: GGUF preparation, kernel build).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from kettle.bench.process import KettleServer

PROMPT = "<|im_start|>user\nWrite a long story about a dragon who learns to cook.<|im_end|>\n<|im_start|>assistant\n"


def decode_rate(url: str, max_new_tokens: int) -> float:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": max_new_tokens}}
    arrivals = []
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and '"token"' in line:
                arrivals.append(time.perf_counter())
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


def start(tree: str, flags: list[str], cache: str | None) -> tuple[KettleServer, float]:
    env = {"PYTHONPATH": str(Path(tree).resolve())} | ({"KETTLE_CACHE": cache} if cache else {})
    started = time.perf_counter()
    server = KettleServer(None, *flags, env=env, timeout=1200)
    ready = time.perf_counter() - started
    info = httpx.get(f"{server.url}/info").json()
    print(
        json.dumps({"tree": tree, "flags": flags, "ready_s": round(ready, 1), "quantization": info.get("quantization")})
    )
    decode_rate(server.url, 8)  # warm-up
    return server, ready


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tree", action="append", required=True, help="name=path of a source tree")
    parser.add_argument("--flags", action="append", default=None, help="launcher flags (one configuration each)")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--fresh-cache", action="store_true")
    args = parser.parse_args()
    configs = [(t.split("=", 1), f.split()) for t in args.tree for f in (args.flags or [""])]
    servers, rates = {}, {}
    try:
        for (name, tree), flags in configs:
            cache = tempfile.mkdtemp(prefix="kettle-cache-") if args.fresh_cache else None
            key = f"{name} {' '.join(flags) or '(no flags)'}"
            servers[key] = start(tree, flags, cache)
            rates[key] = []
        for _ in range(args.requests):
            for key, (server, _) in servers.items():
                rates[key].append(decode_rate(server.url, args.max_new_tokens))
            print(json.dumps({key: round(r[-1], 1) for key, r in rates.items()}), flush=True)
    finally:
        for server, _ in servers.values():
            server.stop()
    first = next(iter(rates.values()))
    for key, (_, ready) in servers.items():
        ratio = statistics.median(r / f for r, f in zip(rates[key], first, strict=True))
        print(f"{key}: start-to-healthy {ready:.1f} s, decode median {statistics.median(rates[key]):.1f} tok/s "
              f"({len(rates[key])} requests), median same-round ratio to the first {ratio:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
