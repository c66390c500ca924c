"""HTTP load generator: N concurrent streams against `/generate_stream`, with TTFT and inter-token latency.

    .venv/bin/python -m kettle.bench.loadgen                       # bundled model, 1/4/8/16 streams, 128 tokens
    .venv/bin/python -m kettle.bench.loadgen --url http://127.0.0.1:3000 --streams 1,4

Prints `| method | streams | prefill tok/s | decode tok/s | TTFT p50/p99 | ITL p50/p99 |`, one row per
concurrency. All streams of a row start at once. prefill tok/s: the prompt tokens of all streams over the time
until the last stream's first token (what the server prefilled, queueing included); decode tok/s: the tokens
after each stream's first, over the time from the first first-token to the last token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

# Requests for long answers: an instruct model stops at once on prompts that do not ask for much.
PROMPTS = (
    "Write a long story about a dragon who learns to cook.",
    "Explain in detail how a steam engine works.",
    "Write an essay about the history of the printing press.",
    "Describe a walk through a busy market in Marrakesh.",
    "Write a detailed recipe for bread, with every step explained.",
    "Tell me about the life of a honey bee from egg to adult.",
    "Explain how computers store numbers in memory.",
    "Write a travel guide for a small mountain village.",
)


@dataclass
class StreamTiming:
    """One stream: when it started, when each token arrived, and its prompt length (from the stream details)."""

    start: float
    arrivals: list[float] = field(default_factory=list)
    prompt_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.start

    @property
    def inter_token(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


@dataclass
class LoadResult:
    """A whole load run: aggregate throughput and latency percentiles."""

    concurrency: int
    wall: float
    streams: list[StreamTiming]

    @property
    def tokens(self) -> int:
        return sum(len(s.arrivals) for s in self.streams)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens of all streams over the time from the start to the last first token."""
        span = max(s.arrivals[0] for s in self.streams) - min(s.start for s in self.streams)
        return sum(s.prompt_tokens for s in self.streams) / span if span > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first of each stream, over the time from first to last token (decode only)."""
        decoded = sum(len(s.arrivals) - 1 for s in self.streams)
        span = max(s.arrivals[-1] for s in self.streams) - min(s.arrivals[0] for s in self.streams)
        return decoded / span if span > 0 else float("nan")

    def percentile(self, values: list[float], p: float) -> float:
        return percentile(values, p)

    def summary(self) -> dict[str, float]:
        ttft = [s.ttft for s in self.streams]
        itl = [x for s in self.streams for x in s.inter_token]
        return {
            "tok/s": self.tokens_per_s,
            "prefill tok/s": self.prefill_tokens_per_s,
            "decode tok/s": self.decode_tokens_per_s,
            "ttft p50": percentile(ttft, 0.5),
            "ttft p99": percentile(ttft, 0.99),
            "itl p50": statistics.median(itl) if itl else float("nan"),
            "itl p99": percentile(itl, 0.99),
        }


def percentile(values: Sequence[float], p: float) -> float:
    """The p-quantile by nearest rank (NaN for no values)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))] if ordered else float("nan")


async def stream_tokens(
    client: aiohttp.ClientSession,
    url: str,
    prompt: str,
    max_new_tokens: int,
    timing: StreamTiming | None = None,
    parameters: dict | None = None,
) -> StreamTiming:
    """Streams one greedy request (with any other `parameters`, e.g. a grammar), recording each token's arrival;
    `timing` lets a caller watch it live."""
    body = {"inputs": prompt, "parameters": {**(parameters or {}), "max_new_tokens": max_new_tokens, "details": True}}
    timing = timing or StreamTiming(time.perf_counter())
    async with client.post(f"{url}/generate_stream", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data:"):
                event = json.loads(line.removeprefix(b"data:"))
                if "error" in event:
                    raise RuntimeError(event["error"])
                timing.arrivals.append(time.perf_counter())
                timing.prompt_tokens = (event.get("details") or {}).get("input_length", timing.prompt_tokens)
    return timing


def session() -> aiohttp.ClientSession:
    """The load's HTTP client: aiohttp, as TGI's own Python client (`text_generation.AsyncClient`) uses. It spends
    about half of httpx's CPU per streamed token (0.06 against 0.13-0.20 ms here), and on a small machine the
    client's CPU is taken from the server it measures. No cap on connections: every stream starts at once."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600), connector=aiohttp.TCPConnector(limit=0))


async def run_load(
    url: str, prompts: Sequence[str], concurrency: int, max_new_tokens: int, parameters: dict | None = None
) -> LoadResult:
    """Runs `concurrency` streams at once, stream i on prompts[i % len(prompts)]."""
    async with session() as client:
        start = time.perf_counter()
        calls = [
            stream_tokens(client, url, prompts[i % len(prompts)], max_new_tokens, parameters=parameters)
            for i in range(concurrency)
        ]
        streams = await asyncio.gather(*calls)
    return LoadResult(concurrency, time.perf_counter() - start, list(streams))


def markdown_table(results: dict[int, LoadResult], method: str = "kettle") -> str:
    """The issue's table: one row per concurrency, latencies in milliseconds."""
    lines = [
        "| method | streams | prefill tok/s | decode tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for concurrency, result in results.items():
        s = result.summary()
        lines.append(
            f"| {method} | {concurrency} | {s['prefill tok/s']:.1f} | {s['decode tok/s']:.1f} | "
            f"{s['ttft p50'] * 1e3:.1f} | {s['ttft p99'] * 1e3:.1f} | {s['itl p50'] * 1e3:.1f} | "
            f"{s['itl p99'] * 1e3:.1f} |"
        )
    return "\n".join(lines)


def chat_prompts(model_path: str, prompts: Sequence[str] = PROMPTS) -> list[str]:
    """`prompts` rendered with the model's chat template as text (Kettle tokenizes it the same way)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if not tokenizer.chat_template:
        return list(prompts)
    render = tokenizer.apply_chat_template
    return [render([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in prompts]


def measure(url: str, prompts: Sequence[str], streams: Sequence[int], max_new_tokens: int) -> dict[int, LoadResult]:
    """One warm-up run, then one run per concurrency."""
    asyncio.run(run_load(url, prompts, 2, 8))  # the server's first-call paths
    return {c: asyncio.run(run_load(url, prompts, c, max_new_tokens)) for c in streams}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (default: start one on --model-id)")
    parser.add_argument("--model-id", help="model to serve, and whose chat template renders the prompts")
    parser.add_argument("--streams", default="1,4,8,16", help="concurrencies, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--method", default="kettle", help="the `method` column")
    parser.add_argument("--server-args", default="", help="extra `kettle launch` flags, space-separated")
    args = parser.parse_args(argv)
    streams = [int(x) for x in args.streams.split(",")]
    if args.url:
        prompts = chat_prompts(args.model_id) if args.model_id else list(PROMPTS)
        results = measure(args.url, prompts, streams, args.max_new_tokens)
    else:
        results = _measure_own_server(args, streams)
    print(markdown_table(results, args.method))


def _measure_own_server(args: argparse.Namespace, streams: list[int]) -> dict[int, LoadResult]:
    from kettle.bench.process import KettleServer
    from kettle.hub import resolve_model

    model_path = str(resolve_model(args.model_id).path)
    server = KettleServer(model_path, "--max-concurrent-requests", "256", *args.server_args.split())
    try:
        return measure(server.url, chat_prompts(model_path), streams, args.max_new_tokens)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
