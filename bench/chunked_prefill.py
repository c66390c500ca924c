"""Inter-token latency of running streams while a long prompt is prefilled, with chunked prefill on and off.

    .venv/bin/python bench/chunked_prefill.py         # bundled SmolLM2-135M: 4 streams, a 2,000-token prompt
    .venv/bin/python bench/chunked_prefill.py --streams 2 --stream-tokens 48 --prompt-tokens 500 --trials 1

Method: a server per mode: chunking on (`--max-batch-prefill-tokens BUDGET` when given) with the adaptive chunk
size (the default) and with a fixed one (`KETTLE_ADAPTIVE_CHUNKS=0`: every chunk up to BUDGET), and
`--disable-chunked-prefill`. Per trial, `--streams` greedy streams start (chat prompts asking for long
answers); once each has `--lead-tokens` tokens, a prompt of about `--prompt-tokens` tokens (unique per trial,
so never a prefix-cache hit) arrives. Printed per mode: the median, p99 and max of the running streams'
inter-token latencies (all their gaps, every trial), the same for the gaps that overlap the long prompt's
prefill (from sending it to its first token), and the long prompt's time to first token. The target: p99 <= 3x
median while it is prefilled.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass

import httpx

from kettle.bench.loadgen import StreamTiming, chat_prompts, percentile, session, stream_tokens
from kettle.bench.process import KettleServer

WORDS = ("kettle", "steam", "water", "leaf", "cup", "pour", "brew", "green", "black", "oolong", "milk", "sugar")


@dataclass
class Trial:
    """The running streams of one trial and the long prompt's send / first-token times."""

    streams: list[StreamTiming]
    sent: float
    first_token: float

    def gaps(self, during: bool) -> list[float]:
        """Inter-token gaps of the running streams; `during`: only those overlapping the long prefill."""
        out = []
        for stream in self.streams:
            for a, b in zip(stream.arrivals, stream.arrivals[1:], strict=False):
                if not during or (b > self.sent and a < self.first_token):
                    out.append(b - a)
        return out


def long_prompt(url: str, trial: int, tokens: int) -> str:
    """About `tokens` tokens of text, its first words naming the trial (so no two trials share a block)."""
    text, i = f"Trial {trial}. Summarise the following notes:", 0
    while True:
        n = len(httpx.post(f"{url}/tokenize", json={"inputs": text}, timeout=60).json())
        if n >= tokens:
            return text
        words = max(8, (tokens - n) // 2)
        text += " " + " ".join(WORDS[(i * 7 + j * 3 + trial) % len(WORDS)] for j in range(words))
        i += 1


async def run_trial(url: str, prompts: list[str], long: str, args: argparse.Namespace) -> Trial:
    async with session() as client:
        timings = [StreamTiming(time.perf_counter()) for _ in range(args.streams)]
        calls = [
            stream_tokens(client, url, prompts[i % len(prompts)], args.stream_tokens, t) for i, t in enumerate(timings)
        ]
        running = [asyncio.create_task(c) for c in calls]
        while min(len(t.arrivals) for t in timings) < args.lead_tokens:
            await asyncio.sleep(0.005)
        probe = StreamTiming(time.perf_counter())
        await stream_tokens(client, url, long, 2, probe)
        await asyncio.gather(*running)
    return Trial(timings, probe.start, probe.arrivals[0])


def measure(model_path: str, flags: list[str], env: dict[str, str], args: argparse.Namespace) -> list[Trial]:
    flags = ["--max-concurrent-requests", "64", *flags, *args.server_args.split()]
    server = KettleServer(model_path, *flags, env=env, timeout=900)  # a loaded machine starts slowly
    try:
        prompts = chat_prompts(model_path)
        asyncio.run(run_trial(server.url, prompts, long_prompt(server.url, -1, args.prompt_tokens), args))  # warm
        trials = []
        for n in range(args.trials):
            trials.append(
                asyncio.run(run_trial(server.url, prompts, long_prompt(server.url, n, args.prompt_tokens), args))
            )
        return trials
    finally:
        server.stop()


HEADER = (
    "| mode | ITL p50 | ITL p99 | ITL max | p99/p50 | during prefill: ITL p50 | p99 | max | p99/p50 | long TTFT |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def report(name: str, trials: list[Trial]) -> str:
    """One table row: latencies in milliseconds."""

    def stats(gaps: list[float]) -> str:
        median, p99 = statistics.median(gaps), percentile(gaps, 0.99)
        return f"{median * 1e3:.1f} | {p99 * 1e3:.1f} | {max(gaps) * 1e3:.1f} | {p99 / median:.2f}x"

    every = [g for t in trials for g in t.gaps(during=False)]
    during = [g for t in trials for g in t.gaps(during=True)]
    ttft = statistics.median(t.first_token - t.sent for t in trials)
    return f"| {name} | {stats(every)} | {stats(during)} | {ttft * 1e3:.1f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", default=None, help="model to serve (default: the bundled SmolLM2)")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=128, help="max_new_tokens of each running stream")
    parser.add_argument("--lead-tokens", type=int, default=8, help="tokens every stream has before the prompt")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--budget", type=int, default=None, help="--max-batch-prefill-tokens with chunking on")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--modes", default="chunked,--disable", help="prefixes of the modes to run")
    parser.add_argument("--server-args", default="", help="extra `kettle launch` flags for both servers")
    args = parser.parse_args()
    from kettle.hub import resolve_model

    model_path = str(resolve_model(args.model_id).path)
    on = ["--max-batch-prefill-tokens", str(args.budget)] if args.budget else []
    budget = args.budget or "default"
    modes = {
        f"chunked, adaptive (max {budget})": (on, {}),
        f"chunked, fixed {budget}": (on, {"KETTLE_ADAPTIVE_CHUNKS": "0"}),
        "--disable-chunked-prefill": (["--disable-chunked-prefill"], {}),
    }
    chosen = [m for m in modes if any(m.startswith(p) for p in args.modes.split(","))]
    print(f"{args.streams} streams, {args.prompt_tokens}-token prompt, {args.trials} trials; times in ms")
    print(HEADER, flush=True)
    for name in chosen:  # each row as soon as it is measured
        print(report(name, measure(model_path, *modes[name], args)), flush=True)


if __name__ == "__main__":
    main()
