"""Overlap scheduling and `--speculate` over HTTP, compared in one run on the same server flags.

    .venv/bin/python bench/overlap_speculate.py                          # bundled model, --quantize int4, 3 rounds
    .venv/bin/python bench/overlap_speculate.py --rounds 1 --max-new-tokens 64 --configs off,overlap
    .venv/bin/python bench/overlap_speculate.py --configs off,speculate,speculate-always
    .venv/bin/python bench/overlap_speculate.py --in-process --rounds 7 --configs off,speculate,speculate-always
    .venv/bin/python bench/overlap_speculate.py --in-process --rounds 5 --configs off,speculate-7rows,speculate
    .venv/bin/python bench/overlap_speculate.py --server-args "" --configs off,speculate --together --rounds 7

Configurations (each its own server; the rounds alternate them so machine drift hits all alike):
- `off`: the default, the shard waits for each call;
- `overlap`: `KETTLE_OVERLAP=1`, the next decode step computed while the router handles the last one;
- `speculate`: the default plus `--speculate 4`;
- `speculate-always`: `--speculate 4` drafting every step in full from 1-gram matches on (the drafting before
  it weighed acceptance against cost: `KETTLE_SPECULATE_MIN_NGRAM=1 KETTLE_SPECULATE_ROW_COST=0`);
- `speculate-7rows`: `--speculate 4` with steps of up to 7 rows on the CPU, the rule before a step was held to
  one pass of the integer kernels (`KETTLE_SPECULATE_STEP_ROWS=7`);
- `rows`, `speculate-rows`: `off` and `speculate` with the weights in rows instead of lanes (`KETTLE_CPU_LANES=0`,
  AVX-512 VNNI CPUs).

Workloads: kettle.bench.loadgen's chat prompts at 1 and 16 streams (decode tok/s as loadgen defines it), and a
copy-heavy single stream: the model is asked to repeat a ~500-token passage (this repository's
docs/architecture.md) word for word. Each cell is the median of the rounds (the table also gives each
round's ratio to `off` in the same round, whose median is the figure to quote on a shared machine).

`--together` starts every configuration's server at once and alternates them workload by workload (the order
reversed every other round), so a round's ratio compares runs seconds apart, not minutes: one server waits idle
while the other is measured (each holds its own KV cache: ~3 GB apiece on the bundled model).

`--in-process` runs the same workloads on one shard engine, no server: the router's round trip is left out, and
the configurations alternate workload by workload (seconds apart, not minutes), which a busy shared machine
needs to show a ratio at all. Only `off` and the `speculate` configurations (and `--quantize` of
`--server-args`) apply there. Its tok/s are the generated tokens after each request's first over the wall time
of the steps that made them. Its decode calls run up to `--max-steps` steps (8: about what a settled router's
50 ms window gives one stream; 1 for the one-step calls of the runs before greedy windows).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

from kettle import settings
from kettle.bench.loadgen import chat_prompts, run_load
from kettle.bench.process import KettleServer
from kettle.hub import resolve_model
from kettle.proto import generate_pb2 as pb

CONFIGS = {
    "off": ({}, []),
    "overlap": ({"KETTLE_OVERLAP": "1"}, []),
    "speculate": ({}, ["--speculate", "4"]),
    "speculate-always": ({"KETTLE_SPECULATE_MIN_NGRAM": "1", "KETTLE_SPECULATE_ROW_COST": "0"}, ["--speculate", "4"]),
    "speculate-7rows": ({"KETTLE_SPECULATE_STEP_ROWS": "7"}, ["--speculate", "4"]),
    "rows": ({"KETTLE_CPU_LANES": "0"}, []),
    "speculate-rows": ({"KETTLE_CPU_LANES": "0"}, ["--speculate", "4"]),
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


def start(model_path: str, flags: list[str], env: dict[str, str]) -> KettleServer:
    """The server, started again once if its launcher stops while starting: on the shared machine this bench
    runs on, other jobs' clean-ups have sent it SIGINT, which is no measurement of ours."""
    try:
        return KettleServer(model_path, *flags, env=env)
    except RuntimeError as error:
        print(f"server start failed, trying again: {str(error).splitlines()[0]}", flush=True)
        return KettleServer(model_path, *flags, env=env)


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
    parser.add_argument("--in-process", action="store_true", help="one shard engine, no server (see above)")
    parser.add_argument("--together", action="store_true", help="every configuration's server up at once (see above)")
    parser.add_argument(
        "--max-steps", type=int, default=8, help="in process: decode steps a call may run (a settled router's window)"
    )
    args = parser.parse_args()
    model_path = str(resolve_model(args.model_id).path)
    chat, copy = chat_prompts(model_path), copy_prompt(model_path)
    if args.in_process:
        print_table(in_process(model_path, args, chat, copy))
        return
    if args.together:
        print_table(together(model_path, args, chat, copy))
        return
    rounds: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for name in args.configs.split(","):
            env, flags = CONFIGS[name]
            server = start(model_path, [*args.server_args.split(), *flags], {**os.environ, **env})
            try:
                rates = measure(server.url, chat, copy, args.max_new_tokens)
            finally:
                server.stop()
            print(name, {k: round(v, 1) for k, v in rates.items()}, flush=True)
            rounds.setdefault(name, []).append(rates)
    print_table(rounds)


def together(model_path: str, args: argparse.Namespace, chat: list[str], copy: str) -> dict[str, list]:
    """Every configuration's server at once; each round runs every workload under each configuration in turn."""
    names = args.configs.split(",")
    servers = {}
    try:
        for name in names:
            env, flags = CONFIGS[name]
            servers[name] = start(model_path, [*args.server_args.split(), *flags], {**os.environ, **env})
            asyncio.run(run_load(servers[name].url, chat, 2, 8))  # the server's first-call paths
        workloads = {"chat x1": (chat, 1), "chat x16": (chat, 16), "copy x1": ([copy], 1)}
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        for round_ in range(args.rounds):
            rates: dict[str, dict[str, float]] = {name: {} for name in names}
            for workload, (prompts, streams) in workloads.items():
                for name in names if round_ % 2 == 0 else names[::-1]:
                    load = run_load(servers[name].url, prompts, streams, args.max_new_tokens)
                    rates[name][workload] = asyncio.run(load).decode_tokens_per_s
            for name in names:
                print(name, {k: round(v, 1) for k, v in rates[name].items()}, flush=True)
                rounds[name].append(rates[name])
        return rounds
    finally:
        for server in servers.values():
            server.stop()


def in_process(model_path: str, args: argparse.Namespace, chat: list[str], copy: str) -> dict[str, list]:
    """Each round runs every workload under each configuration in turn (the order reversed every other round)."""
    from transformers import AutoTokenizer

    from kettle.shard.config import ShardConfig
    from kettle.shard.server import build_engine

    flags = argparse.ArgumentParser()
    flags.add_argument("--quantize")
    quantize = flags.parse_known_args(args.server_args.split())[0].quantize
    engine, _ = build_engine(ShardConfig(model_path=model_path, quantize=quantize))
    warm = pb.WarmupRequest(max_input_tokens=1024, max_prefill_tokens=1024, max_total_tokens=1024)
    warm.batch.requests.add(id=0, input_ids=[1, 2, 3]).stopping_parameters.max_new_tokens = 1
    engine.warmup(warm)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    encode = [tokenizer(text, add_special_tokens=False).input_ids for text in chat]
    workloads = {"chat x1": encode[:1], "chat x16": [encode[i % len(encode)] for i in range(16)]}
    workloads["copy x1"] = [tokenizer(copy, add_special_tokens=False).input_ids]
    names = args.configs.split(",")
    engine.runner.speculate = 4
    _decode_rate(engine, workloads["chat x16"][:2], 8)  # the first steps' one-time costs, as `measure` does
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        rates: dict[str, dict[str, float]] = {name: {} for name in names}
        for workload, prompts in workloads.items():
            for name in names if round_ % 2 == 0 else names[::-1]:
                env, flags_ = CONFIGS[name]
                for key in SPECULATE_ENV:
                    os.environ.pop(key, None)
                os.environ.update(env)
                settings.reload()
                engine.runner.speculate = 4 if "--speculate" in flags_ else 0
                rates[name][workload] = _decode_rate(engine, prompts, args.max_new_tokens, args.max_steps)
        for name in names:
            print(name, {k: round(v, 1) for k, v in rates[name].items()}, flush=True)
            rounds[name].append(rates[name])
    return rounds


SPECULATE_ENV = ("KETTLE_SPECULATE_MIN_NGRAM", "KETTLE_SPECULATE_ROW_COST", "KETTLE_SPECULATE_STEP_ROWS")


def _decode_rate(engine, prompts: list[list[int]], max_new_tokens: int, max_steps: int = 1) -> float:
    """Greedy to EOS or max_new_tokens as loadgen asks, in decode calls of up to `max_steps` steps (greedy
    windows where the batch allows); tokens after each request's first per second of steps."""
    batch, block = pb.Batch(id=1), 0
    for i, ids in enumerate(prompts):
        request = batch.requests.add(id=i + 1, input_ids=ids)
        request.stopping_parameters.max_new_tokens = max_new_tokens
        blocks = -(-(len(ids) + max_new_tokens) // 16)
        request.blocks.extend(range(block, block + blocks))
        block += blocks
    assert block <= engine.runner.kv_cache.num_blocks, "the warmup's KV cache is too small for these prompts"
    answer = engine.prefill(pb.PrefillRequest(batch=batch))
    start, tokens = time.perf_counter(), 0
    while answer.HasField("batch"):
        answer = engine.decode(pb.DecodeRequest(batches=[answer.batch], max_steps=max_steps))
        tokens += sum(len(g.tokens.ids) for g in answer.generations)
    return tokens / (time.perf_counter() - start)


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
