"""Time to first token with and without prefix caching, for prompts that share a long prefix.

    .venv/bin/python bench/prefix_cache.py                 # bundled SmolLM2-135M, 1,000-token prefix, 5 trials

Method: each trial builds a fresh prefix of about `--prefix-tokens` tokens (unique per trial, so nothing is
cached before it), then streams two prompts one after the other: prefix + question A (always a full prefill),
then prefix + question B (a cache hit when prefix caching is on). TTFT is the time from sending the request to
the first SSE event. The same trials run against a server started with `--disable-prefix-caching`; the table
prints medians and the speedup of the second request.
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

from kettle.bench.process import KettleServer

WORDS = "kettle steam water leaf cup pour brew green black oolong milk sugar lemon honey spoon tray"


def make_prefix(url: str, trial: int, tokens: int) -> str:
    """A prefix of about `tokens` tokens, different for each trial (its first words name the trial)."""
    words = WORDS.split()
    text = f"Trial {trial}. Context:"
    i = 0
    while len(httpx.post(f"{url}/tokenize", json={"inputs": text}, timeout=30).json()) < tokens:
        text += " " + " ".join(words[(i * 7 + j * 3 + trial) % len(words)] for j in range(50))
        i += 1
    return text


def ttft(url: str, inputs: str) -> float:
    """Seconds until the first streamed token of a greedy request."""
    body = {"inputs": inputs, "parameters": {"max_new_tokens": 4}}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=120) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data:"):
                first = time.perf_counter() - start
                break
        for _ in lines:  # drain, so the next request starts on an idle server
            pass
    return first


def measure(flags: list[str], trials: int, tokens: int) -> tuple[list[float], list[float]]:
    """TTFT of the first and of the second request of each trial, on a server started with `flags`."""
    server = KettleServer(None, *flags)
    try:
        ttft(server.url, "warm up")
        firsts, seconds = [], []
        for trial in range(trials):
            prefix = make_prefix(server.url, trial, tokens)
            firsts.append(ttft(server.url, prefix + " Question: what is brewed first?"))
            seconds.append(ttft(server.url, prefix + " Question: which cup is the largest?"))
        return firsts, seconds
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    args = parser.parse_args()
    rows = []
    for name, flags in (("prefix caching on", []), ("--disable-prefix-caching", ["--disable-prefix-caching"])):
        firsts, seconds = measure(flags, args.trials, args.prefix_tokens)
        rows.append((name, statistics.median(firsts), statistics.median(seconds)))
    print(f"{'server':28} {'TTFT 1st (miss) ms':>20} {'TTFT 2nd ms':>14} {'2nd speedup':>12}")
    for name, first, second in rows:
        print(f"{name:28} {first * 1000:20.1f} {second * 1000:14.1f} {first / second:11.2f}x")
    print(f"hit vs no cache, 2nd request: {rows[1][2] / rows[0][2]:.2f}x faster")


if __name__ == "__main__":
    main()
