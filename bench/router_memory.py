"""The router's resident memory under prompts megabytes long: idle, after 20 in a row, after 8 at once.

    PYTHONPATH=. .venv/bin/python bench/router_memory.py [--chars 1900000] [--truncate N] [--route /generate]

Starts `kettle launch` as `make serve` does (the bundled model, no flags), then sends 20 prompts of `--chars`
characters (random words) one after another and 8 at once, each with `max_new_tokens` 10; without `--truncate`
every one is over the token limits and answered 422. It prints the router's RSS (the launcher's child running
`kettle router`) idle, at its highest and 10 s after each round: the issue's measure of memory the router keeps.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kettle.bench.process import KettleServer

MiB = 2**20
SENTENCE = "the kettle boils water for tea in a small kitchen at dawn while birds sing outside"
WORDS = SENTENCE.split()


def router_rss(server: KettleServer) -> int:
    children = psutil.Process(server.process.pid).children(recursive=True)
    (router,) = [child for child in children if "router" in child.cmdline()]
    return router.memory_info().rss


def prompt(rng: random.Random, chars: int) -> str:
    words = [rng.choice(WORDS) for _ in range(chars // 4)]
    return " ".join(words)[:chars]


async def round_of(server: KettleServer, bodies: list[dict], at_once: bool, route: str) -> tuple[int, set[int]]:
    """Sends the bodies (in turn, or all at once); returns the highest RSS seen meanwhile and the statuses."""
    highest, statuses = router_rss(server), set()

    async def watch() -> None:
        nonlocal highest
        while True:
            highest = max(highest, router_rss(server))
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
        if at_once:
            responses = await asyncio.gather(*(client.post(route, json=body) for body in bodies))
        else:
            responses = [await client.post(route, json=body) for body in bodies]
    watcher.cancel()
    statuses.update(response.status_code for response in responses)
    return highest, statuses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chars", type=int, default=1_900_000)
    parser.add_argument("--truncate", type=int, default=None)
    parser.add_argument("--route", default="/generate")
    args = parser.parse_args()
    rng = random.Random(0)
    parameters = {"max_new_tokens": 10} | ({"truncate": args.truncate} if args.truncate else {})
    server = KettleServer(None)
    try:
        time.sleep(3)
        print(f"idle: {router_rss(server) / MiB:.0f} MiB", flush=True)
        for count, at_once in ((20, False), (8, True)):
            bodies = [{"inputs": prompt(rng, args.chars), "parameters": parameters} for _ in range(count)]
            started = time.monotonic()
            highest, statuses = asyncio.run(round_of(server, bodies, at_once, args.route))
            took = time.monotonic() - started
            time.sleep(10)
            how = "at once" if at_once else "in a row"
            print(
                f"{count} {how} ({took:.1f} s, statuses {sorted(statuses)}): highest {highest / MiB:.0f} MiB, "
                f"10 s after {router_rss(server) / MiB:.0f} MiB",
                flush=True,
            )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
