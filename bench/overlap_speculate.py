"""Overlap scheduling and `--speculate` over HTTP, compared in one run on the same server flags.

    .venv/bin/python bench/overlap_speculate.py                          # bundled model, --quantize int4, 3 rounds
    .venv/bin/python bench/overlap_speculate.py --rounds 1 --max-new-tokens 64 --configs off,overlap
    .venv/bin/python bench/overlap_speculate.py --configs off,speculate,speculate-always

Configurations (each its own server; the rounds alternate them so machine drift hits all alike):
- `off`: the default, the shard waits for each call;
- `overlap`: `KETTLE_OVERLAP=1`, the next decode step computed while the router handles the last one;
- `speculate`: the default plus `--speculate 4`;
- `speculate-always`: `--speculate 4` drafting every step in full from 1-gram matches on (the drafting before
  it weighed acceptance against cost: `KETTLE_SPECULATE_MIN_NGRAM=1 KETTLE_SPECULATE_ROW_COST=0`).

Workloads: kettle.bench.loadgen's chat prompts at 1 and 16 streams (decode tok/s as loadgen defines it), and a
copy-heavy single stream: the model is asked to repeat a ~500-token passage (this repository's
docs/architecture.md) word for word. Each cell is the median of the rounds (the table also gives each
round's ratio to `off` in the same round, whose median is the figure to quote on a shared machine).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from pathlib import Path

from kettle.bench.loadgen import chat_prompts, run_load
from kettle.bench.process import KettleServer
from kettle.hub import resolve_model

CONFIGS = {
    "off": ({}, []),
    "overlap": ({"KETTLE_OVERLAP": "1"}, []),
    "speculate": ({}, ["--speculate", "4"]),
    "speculate-always": ({"KETTLE_SPECULATE_MIN_NGRAM": "1", "KETTLE_SPECULATE_ROW_COST": "0"}, ["--speculate", "4"]),
}
PASSAGE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def copy_prompt(model_path: str, tokens: int = 500, started: int = 16) -> str:
    """A chat prompt asking to repeat the first `tokens` tokens of PASSAGE, the answer begun with its first
    `started` tokens: a 135M model asked cold may answer something else (the bundled one starts writing code),
    which would measure chat, not copying; begun, it goes on copying."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = tokenizer(PASSAGE.read_text()).input_ids
    passage = tokenizer.decode(ids[:tokens])
    ask = f"Repeat the following text exactly, word for word:\n\n{passage}"
    return chat_prompts(model_path, [ask])[0] + tokenizer.decode(ids[:started])


def measure(url: str, chat: list[str], copy: str, max_new_tokens: int) -> dict[str, float]:
    asyncio.run(run_load(url, chat, 2, 8))  # the server's first-call paths
    rates = {f"chat x{n}": asyncio.run(run_load(url, chat, n, max_new_tokens)).decode_tokens_per_s for n in (1, 16)}
    rates["copy x1"] = asyncio.run(run_load(url, [copy], 1, max_new_tokens)).decode_tokens_per_s
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", help="default: the bundled model")
    parser.add_argument("--server-args", default="--quantize int4")
    parser.add_argument("--configs", default="off,overlap,speculate")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    model_path = str(resolve_model(args.model_id).path)
    chat, copy = chat_prompts(model_path), copy_prompt(model_path)
    rounds: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for name in args.configs.split(","):
            env, flags = CONFIGS[name]
            server = KettleServer(model_path, *args.server_args.split(), *flags, env={**os.environ, **env})
            try:
                rates = measure(server.url, chat, copy, args.max_new_tokens)
            finally:
                server.stop()
            print(name, {k: round(v, 1) for k, v in rates.items()}, flush=True)
            rounds.setdefault(name, []).append(rates)
    print_table(rounds)


def print_table(rounds: dict[str, list[dict[str, float]]]) -> None:
    """Median tok/s per cell; beside it, the median over rounds of the ratio to `off` in the same round (each
    round's servers ran minutes apart, so the ratio cancels most of the machine's drift)."""
    base = rounds.get("off")
    print("| config | chat x1 tok/s | chat x16 tok/s | copy x1 tok/s |\n|---|---|---|---|")
    for name, runs in rounds.items():
        cells = []
        for key in runs[0]:
            cell = f"{statistics.median(r[key] for r in runs):.1f}"
            if base is not None and name != "off":
                ratios = [r[key] / b[key] for r, b in zip(runs, base, strict=True)]
                cell += f" ({statistics.median(ratios):.2f}x: " + ", ".join(f"{x:.2f}" for x in ratios) + ")"
            cells.append(cell)
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
