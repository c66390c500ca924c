"""The benchmarks' HTTP measuring loop: N concurrent streams against `/generate_stream`, with TTFT and inter-token
latency, as a client sees them.

Every served benchmark (`python -m bench ...`) measures through `run_load`; `python -m bench served --load`
prints its table, `| method | streams | prefill tok/s | decode tok/s | TTFT p50/p99 | ITL p50/p99 |`, one row per
concurrency. All streams of a row start at once. prefill tok/s: the prompt tokens of all streams over the time
until the last stream's first token (what the server prefilled, queueing included); decode tok/s: the tokens
after each stream's first, over the time from the first first-token to the last token.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp
import httpx

# Requests for long answers (an instruct model stops at once on prompts that do not ask for much); stream i of a
# load gets prompt i, so up to 16 concurrent streams each ask something of their own.
PROMPTS = (
    "Write a long story about a dragon who learns to cook.",
    "Explain in detail how a steam engine works.",
    "Write an essay about the history of the printing press.",
    "Describe a walk through a busy market in Marrakesh.",
    "Explain why the sky is blue, step by step, for a child.",
    "Write a detailed recipe for bread, with every step explained.",
    "Tell me about the life of a honey bee from egg to adult.",
    "Write a letter to a friend describing your summer holiday.",
    "Explain how computers store numbers in memory.",
    "Describe the water cycle and why it matters for farming.",
    "Write a short play about two robots meeting for the first time.",
    "Explain the rules of chess to a beginner.",
    "Describe how a city changes from morning to night.",
    "Write a product review of an imaginary electric bicycle.",
    "Explain how vaccines train the immune system.",
    "Write a travel guide for a small mountain village.",
)
# Words of the long prompts `prompt_of_tokens` writes.
WORDS = ("kettle", "steam", "water", "leaf", "cup", "pour", "brew", "green", "black", "oolong", "milk", "sugar")
WORDS += ("lemon", "honey", "spoon", "tray")


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
    url: str,
    prompts: Sequence[str],
    concurrency: int,
    max_new_tokens: int,
    parameters: dict | Sequence[dict | None] | None = None,
) -> LoadResult:
    """Runs `concurrency` streams at once, stream i on prompts[i % len(prompts)] with `parameters` (the same for
    every stream, or stream i's at index i % len(parameters))."""
    each = [parameters] if parameters is None or isinstance(parameters, dict) else list(parameters)
    async with session() as client:
        start = time.perf_counter()
        calls = [
            stream_tokens(client, url, prompts[i % len(prompts)], max_new_tokens, parameters=each[i % len(each)])
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
    warm_up(url, prompts)
    return {c: asyncio.run(run_load(url, prompts, c, max_new_tokens)) for c in streams}


def warm_up(url: str, prompts: Sequence[str]) -> None:
    """Two short streams: the server's first-call paths, kept out of what is measured."""
    asyncio.run(run_load(url, prompts, 2, 8))


def prompt_of_tokens(url: str, tokens: int, trial: int, lead: str = "Context:") -> str:
    """About `tokens` tokens of text (counted by the server's /tokenize), its first words naming `trial`, so that
    no two trials share a KV block (never a prefix-cache hit between them)."""
    text, i = f"Trial {trial}. {lead}", 0
    while True:
        n = len(httpx.post(f"{url}/tokenize", json={"inputs": text}, timeout=60).json())
        if n >= tokens:
            return text
        words = max(8, min(50, (tokens - n) // 2))
        text += " " + " ".join(WORDS[(i * 7 + j * 3 + trial) % len(WORDS)] for j in range(words))
        i += 1
