"""HTTP load generator: N concurrent streams against `/generate_stream`, with TTFT and inter-token latency."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class StreamTiming:
    """One stream: when it started, when each token arrived."""

    start: float
    arrivals: list[float] = field(default_factory=list)

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
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first of each stream, over the time from first to last token (decode only)."""
        decoded = sum(len(s.arrivals) - 1 for s in self.streams)
        span = max(s.arrivals[-1] for s in self.streams) - min(s.arrivals[0] for s in self.streams)
        return decoded / span if span > 0 else float("nan")

    def percentile(self, values: list[float], p: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))] if ordered else float("nan")

    def summary(self) -> dict[str, float]:
        ttft = [s.ttft for s in self.streams]
        itl = [x for s in self.streams for x in s.inter_token]
        return {
            "tok/s": self.tokens_per_s,
            "decode tok/s": self.decode_tokens_per_s,
            "ttft p50": self.percentile(ttft, 0.5),
            "ttft p99": self.percentile(ttft, 0.99),
            "itl p50": statistics.median(itl) if itl else float("nan"),
            "itl p99": self.percentile(itl, 0.99),
        }


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, max_new_tokens: int) -> StreamTiming:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}
    timing = StreamTiming(time.perf_counter())
    async with client.stream("POST", f"{url}/generate_stream", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                event = json.loads(line.removeprefix("data:"))
                if "error" in event:
                    raise RuntimeError(event["error"])
                timing.arrivals.append(time.perf_counter())
    return timing


async def run_load(url: str, prompts: list[str], concurrency: int, max_new_tokens: int) -> LoadResult:
    """Runs `concurrency` streams at once, stream i on prompts[i % len(prompts)]."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        start = time.perf_counter()
        calls = [_stream(client, url, prompts[i % len(prompts)], max_new_tokens) for i in range(concurrency)]
        streams = await asyncio.gather(*calls)
    return LoadResult(concurrency, time.perf_counter() - start, list(streams))
