"""Served benchmarks: a served stream against the bare decode step (`served`), `--speculate` and overlap scheduling
(`speculation`), and what LoRA adapters cost (`lora`), each comparing Kettle with itself in one run (two sides
alternated round by round, each round's ratio printed with their median); and what serving costs besides speed:
resident memory (`memory`) and the time to start (`startup`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kettle.bench.loadgen import PROMPTS, LoadResult, chat_prompts, markdown_table, measure, run_load, warm_up
from kettle.bench.process import KettleServer, free_port
from kettle.bench.timing import ratio_summary, same_round

SERVED = """A served stream against the bare decode step, and servers compared with each other.

    .venv/bin/python -m bench served                       # bundled model, `make serve`'s defaults, 5 rounds
    .venv/bin/python -m bench served --rounds 7 --engine   # also the shard engine in this process

Method: one server started as `make serve` starts it (no flags, its own subprocesses), and in this process the
same model folder loaded as a shard loads it (default scheme and KV cache dtype). Each round streams three of
kettle.bench.loadgen's chat prompts to the server one after another (decode tok/s: the tokens after each
stream's first over the time from its first token to its last, summed over the streams; the gaps between
requests, prefills and connection set-up, are left out as the bare step has none), then runs the bare step:
`--max-new-tokens` greedy decode steps of one sequence after a prompt of the same length as the served ones
(kettle/bench/drive.py's DecodeLoop), tok/s = steps / their time. The two never run at once, and each round's
ratio served / bare is printed with the median over the rounds: the target is within 10% (0.9 or more).
`--engine` adds, each round, the shard's engine driven in this process as the router drives it (no server): the
same steps after the same prompt length in Decode calls of up to 8 steps, with greedy windows and then without
(`KETTLE_TUNING=greedy-window=off`), each as a ratio to the bare step.

Servers compared instead of the bare step (same prompts, greedy):

- `--load`: kettle.bench.loadgen's table, one row per concurrency of `--streams` (1,4,8,16): prefill and decode
  tok/s, TTFT and ITL p50/p99 (`--url`: a running server; `--server-args`: flags of the one started).
- `--trees NAME=PATH ...`: each source tree (its kettle package on PYTHONPATH, e.g. an exported older commit)
  with each `--flags` (one configuration each), started one after the other (each timed to /health; with
  `--fresh-cache` from an empty KETTLE_CACHE: GGUF preparation and kernel build included), then served side by
  side: `--requests` rounds each send, for each of `--streams` (1), that many concurrent greedy generations to
  every server in turn; per concurrency the medians and each configuration's median same-round ratio to the first.
- `--shards 1,2`: one server per shard count (`--num-shard`), decode tok/s and ITL at `--streams` (1,4). On a CPU
  the shards split the cores and exchange activations twice per layer: this measures tensor parallelism's
  overhead there, not a speed-up.
- `--grammar`: one server; for each of `--streams` (1,8), rounds alternate an unconstrained run and one under a
  JSON schema that makes the answers run to `--max-new-tokens`; median decode tok/s and their ratio (target: cost
  under 10%).
"""


def served_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench served", description=SERVED, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-id", help="model to serve (default: the bundled model)")
    p.add_argument("--rounds", type=int, help="rounds (5; --grammar 3)")
    p.add_argument("--max-new-tokens", type=int, help="tokens a stream asks for (128; --shards 64)")
    p.add_argument("--threads", type=int, default=2, help="the bare step's threads (the shard's default: all)")
    p.add_argument("--engine", action="store_true", help="also the shard engine in process (see above)")
    p.add_argument("--load", action="store_true", help="loadgen's table at each of --streams")
    p.add_argument("--trees", nargs="+", metavar="NAME=PATH", help="source trees served side by side")
    p.add_argument("--flags", action="append", help="--trees: launcher flags, one configuration each")
    p.add_argument("--requests", type=int, default=5, help="--trees: rounds of requests")
    p.add_argument("--fresh-cache", action="store_true", help="--trees: an empty KETTLE_CACHE for every start")
    p.add_argument("--shards", help="shard counts compared, comma-separated")
    p.add_argument("--grammar", action="store_true", help="decode with and without a JSON-schema grammar")
    p.add_argument("--streams", help="concurrencies, comma-separated (--load 1,4,8,16; --shards 1,4; --grammar 1,8)")
    p.add_argument("--url", help="--load, --grammar: a running server instead of starting one")
    p.add_argument("--method", default="kettle", help="--load: the `method` column")
    p.add_argument("--server-args", default="", help="extra `kettle launch` flags")
    return p


def served(argv: list[str]) -> None:
    args = served_parser().parse_args(argv)
    modes = {"load": ("1,4,8,16", 128, None), "trees": (None, 128, None), "shards": ("1,4", 64, None)}
    modes |= {"grammar": ("1,8", 128, 3), "bare": (None, 128, 5)}
    mode = next((m for m in ("load", "trees", "shards", "grammar") if getattr(args, m)), "bare")
    streams, tokens, rounds = modes[mode]
    args.streams = [int(x) for x in (args.streams or streams or "1").split(",")]
    args.max_new_tokens, args.rounds = args.max_new_tokens or tokens, args.rounds or rounds
    {"load": load, "trees": trees, "shards": shards, "grammar": grammar, "bare": served_vs_bare}[mode](args)


def model_path(model_id: str | None) -> str:
    from kettle.hub import resolve_model

    return str(resolve_model(model_id).path)


# ---- served against bare -----------------------------------------------------------------------------------


def stream_decode_rate(results: list[LoadResult]) -> float:
    """Tokens after each stream's first over the sum of the streams' first-to-last-token spans."""
    streams = [s for result in results for s in result.streams]
    return sum(len(s.arrivals) - 1 for s in streams) / sum(s.arrivals[-1] - s.arrivals[0] for s in streams)


def served_vs_bare(args: argparse.Namespace) -> None:
    import torch

    from kettle.bench.drive import decode_rate, engine_run, shard_engine, tuning
    from kettle.models.registry import load_model

    torch.set_num_threads(args.threads)
    path = model_path(args.model_id)
    prompts = chat_prompts(path)[:3]
    model = load_model(path, torch.float32, "cpu")
    prompt_tokens = 48  # about the chat prompts' rendered length
    engine = shard_engine(path, 512) if args.engine else None
    server = KettleServer(args.model_id, *args.server_args.split())
    ratios, engine_ratios = [], {True: [], False: []}
    try:
        asyncio.run(run_load(server.url, prompts[:1], 1, 16))  # warm-up: the first request's one-off costs
        decode_rate(model, prompt_tokens, 16)
        # The shard faults its KV cache in behind the warm-up (kettle/tensors/zeroed_memory.py: 0.5-4.5 s here);
        # first rounds started without waiting measured 0.44-0.47 where the others gave 0.9-1.1.
        time.sleep(6)
        for r in range(args.rounds):
            # One prompt after another: a single stream at a time.
            loads = [asyncio.run(run_load(server.url, [prompt], 1, args.max_new_tokens)) for prompt in prompts]
            served_rate = stream_decode_rate(loads)
            bare = decode_rate(model, prompt_tokens, args.max_new_tokens)
            ratios.append(served_rate / bare)
            line = f"round {r + 1}: served {served_rate:.1f} tok/s, bare {bare:.1f}, ratio {ratios[-1]:.2f}"
            for window in (True, False) if engine is not None else ():
                with tuning({"greedy-window": window}):
                    ids = [list(range(100, 100 + prompt_tokens))]
                    run = engine_run(
                        engine, ids, args.max_new_tokens + 1, 8, ignore_eos=True, batch_id=10 + 2 * r + window
                    )
                engine_ratios[window].append(run.decode_rate / bare)
                line += f"; engine {'with' if window else 'without'} windows {run.decode_rate:.1f} "
                line += f"({run.decode_rate / bare:.2f})"
            print(line, flush=True)
    finally:
        server.stop()
    print(f"ratio served / bare: {ratio_summary(ratios)}")
    for window, values in engine_ratios.items():
        if values:
            print(f"ratio engine {'with' if window else 'without'} windows / bare: {ratio_summary(values)}")


# ---- servers compared -------------------------------------------------------------------------------------------


def load(args: argparse.Namespace) -> None:
    if args.url:
        prompts = chat_prompts(model_path(args.model_id)) if args.model_id else list(PROMPTS)
        results = measure(args.url, prompts, args.streams, args.max_new_tokens)
    else:
        path = model_path(args.model_id)
        server = KettleServer(path, "--max-concurrent-requests", "256", *args.server_args.split())
        try:
            results = measure(server.url, chat_prompts(path), args.streams, args.max_new_tokens)
        finally:
            server.stop()
    print(markdown_table(results, args.method))


def trees(args: argparse.Namespace) -> None:
    configs = [(t.split("=", 1), f.split()) for t in args.trees for f in (args.flags or [""])]
    prompts = chat_prompts(model_path(None))
    servers, rates = {}, {}
    try:
        for (name, tree), flags in configs:
            root = str(Path(tree).resolve())
            env = {"PYTHONPATH": root}
            env |= {"KETTLE_CACHE": tempfile.mkdtemp(prefix="kettle-cache-")} if args.fresh_cache else {}
            key = f"{name} {' '.join(flags) or '(no flags)'}"
            started = time.perf_counter()
            server = KettleServer(None, *flags, *args.server_args.split(), env=env, timeout=1200, cwd=root)
            servers[key] = (server, time.perf_counter() - started)
            rates |= {(key, streams): [] for streams in args.streams}
            print(json.dumps({"tree": tree, "flags": flags, "ready_s": round(servers[key][1], 1)}), flush=True)
            asyncio.run(run_load(server.url, prompts[:1], 1, 8))  # warm-up
        for _ in range(args.requests):  # each round: every concurrency on every server in turn
            for streams in args.streams:
                for key, (server, _) in servers.items():
                    load = run_load(server.url, prompts, streams, args.max_new_tokens)
                    rates[key, streams].append(asyncio.run(load).decode_tokens_per_s)
            print(json.dumps({f"{key} x{c}": round(r[-1], 1) for (key, c), r in rates.items()}), flush=True)
    finally:
        for server, _ in servers.values():
            server.stop()
    for streams in args.streams:
        first = rates[next(iter(servers)), streams]
        for key, (_, ready) in servers.items():
            mine = rates[key, streams]
            median, ratios = statistics.median(mine), ratio_summary(same_round(mine, first))
            print(f"{key}, {streams} stream(s): start-to-healthy {ready:.1f} s, decode median {median:.1f} tok/s "
                  f"({len(mine)} rounds), same-round ratio to the first {ratios}")  # fmt: skip


def shards(args: argparse.Namespace) -> None:
    path = model_path(args.model_id)
    results = {}
    for n in map(int, args.shards.split(",")):
        flags = ["--num-shard", str(n), "--master-port", str(free_port()), *args.server_args.split()]
        server = KettleServer(path, *flags)
        try:
            results[n] = {
                c: r.summary()
                for c, r in measure(server.url, chat_prompts(path), args.streams, args.max_new_tokens).items()
            }
        finally:
            server.stop()
    base = results[min(results)]
    print(f"\nmodel: {path}\nmax_new_tokens={args.max_new_tokens}, greedy\n")
    print("| shards | streams | decode tok/s | ITL p50 ms | vs 1st row's shards |\n|---|---|---|---|---|")
    for n, rows in results.items():
        for c, s in rows.items():
            ratio = s["decode tok/s"] / base[c]["decode tok/s"]
            print(f"| {n} | {c} | {s['decode tok/s']:.1f} | {s['itl p50'] * 1000:.1f} | {ratio:.2f}x |")


SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "steps": {"type": "array", "items": {"type": "string", "minLength": 20, "maxLength": 120}, "minItems": 20},
    },
    "required": ["title", "steps"],
}


def grammar(args: argparse.Namespace) -> None:
    path = model_path(args.model_id)
    # Chat-formatted requests for long answers: an instruct model stops at once on a bare prompt.
    prompts = [f"{p} Answer in JSON." for p in chat_prompts(path)]
    server = None if args.url else KettleServer(path, "--max-concurrent-requests", "64", *args.server_args.split())
    url = args.url or server.url
    constrained = {"grammar": {"type": "json", "value": SCHEMA}}
    try:
        print("| streams | decode tok/s, no grammar | decode tok/s, JSON schema | ratio | fewest tokens/stream |")
        print("|---|---|---|---|---|")
        for concurrency in args.streams:
            asyncio.run(run_load(url, prompts, concurrency, args.max_new_tokens, constrained))  # warm the grammar
            runs: dict[str, list[LoadResult]] = {"plain": [], "json": []}
            for _ in range(args.rounds):
                runs["plain"].append(asyncio.run(run_load(url, prompts, concurrency, args.max_new_tokens)))
                runs["json"].append(asyncio.run(run_load(url, prompts, concurrency, args.max_new_tokens, constrained)))
            free, bound = (statistics.median(r.decode_tokens_per_s for r in runs[m]) for m in runs)
            fewest = [min(len(s.arrivals) for r in runs[m] for s in r.streams) for m in runs]
            ratios = same_round(
                [r.decode_tokens_per_s for r in runs["json"]], [r.decode_tokens_per_s for r in runs["plain"]]
            )
            row = f"| {concurrency} | {free:.1f} | {bound:.1f} | {ratio_summary(ratios)} | {fewest[0]} / {fewest[1]} |"
            print(row, flush=True)
    finally:
        if server is not None:
            server.stop()


# ---- speculation ---------------------------------------------------------------------------------------------

SPECULATION = """`--speculate N` and overlap scheduling over HTTP, compared in one run on the same server flags.

    .venv/bin/python -m bench speculation                          # bundled model, --quantize int4, 3 rounds
    .venv/bin/python -m bench speculation --rounds 1 --max-new-tokens 64 --configs off,overlap
    .venv/bin/python -m bench speculation --in-process --rounds 7 --configs off,speculate,speculate-always
    .venv/bin/python -m bench speculation --server-args "" --configs off,speculate --together --rounds 7

Configurations (each its own server; the rounds alternate them so machine drift hits all alike):
- `off`: the default, the shard waits for each call;
- `overlap`: `KETTLE_TUNING=overlap=on`, the next decode step computed while the router handles the last one;
- `speculate`: the default plus `--speculate 4`;
- `speculate-always`: `--speculate 4` drafting every step in full from 1-gram matches on (the drafting before
  it weighed acceptance against cost: `KETTLE_TUNING=speculate-min-ngram=1,speculate-row-cost=0`);
- `speculate-7rows`: `--speculate 4` with steps of up to 7 rows on the CPU (`KETTLE_TUNING=speculate-step-rows=7`);
- `rows`, `speculate-rows`: `off` and `speculate` with the weights in rows instead of lanes (`KETTLE_TUNING=lanes=off`,
  AVX-512 VNNI CPUs).

Workloads: kettle.bench.loadgen's chat prompts at 1 and 16 streams (decode tok/s as loadgen defines it), and a
copy-heavy single stream: the model is asked to repeat a ~500-token passage (this repository's
docs/architecture.md) word for word, its answer begun with the passage's first tokens. Each cell is the median of
the rounds, with each round's ratio to `off` in the same round (the figure to quote on a shared machine).

`--together` starts every configuration's server at once and alternates them workload by workload (the order
reversed every other round), so a round's ratio compares runs seconds apart, not minutes (each server holds its
own KV cache). `--in-process` runs the same workloads on one shard engine, no server (kettle/bench/drive.py's
engine_run): the router's round trip is left out, and only `off` and the `speculate` configurations (and
`--quantize` of `--server-args`) apply. Its decode calls run up to `--max-steps` steps (8: about what a settled
router's 50 ms window gives one stream).
"""

# name: (KETTLE_TUNING items, server flags)
CONFIGS = {
    "off": ({}, []),
    "overlap": ({"overlap": "on"}, []),
    "speculate": ({}, ["--speculate", "4"]),
    "speculate-always": ({"speculate-min-ngram": "1", "speculate-row-cost": "0"}, ["--speculate", "4"]),
    "speculate-7rows": ({"speculate-step-rows": "7"}, ["--speculate", "4"]),
    "rows": ({"lanes": "off"}, []),
    "speculate-rows": ({"lanes": "off"}, ["--speculate", "4"]),
}
PASSAGE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def speculation_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench speculation",
        description=SPECULATION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model-id", help="default: the bundled model")
    p.add_argument("--server-args", default="--quantize int4")
    p.add_argument("--configs", default="off,overlap,speculate", help=f"from {', '.join(CONFIGS)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--in-process", action="store_true", help="one shard engine, no server (see above)")
    p.add_argument("--together", action="store_true", help="every configuration's server up at once (see above)")
    p.add_argument("--max-steps", type=int, default=8, help="in process: decode steps a call may run")
    return p


def speculation(argv: list[str]) -> None:
    args = speculation_parser().parse_args(argv)
    names = args.configs.split(",")
    unknown = set(names) - set(CONFIGS)
    if unknown:
        speculation_parser().error(f"unknown configuration(s) {', '.join(sorted(unknown))}")
    path = model_path(args.model_id)
    chat, copy = chat_prompts(path), copy_prompt(path)
    if args.in_process:
        rounds = in_process(path, args, names, chat, copy)
    elif args.together:
        rounds = together(path, args, names, chat, copy)
    else:
        rounds = {}
        for _ in range(args.rounds):
            for name in names:
                server = start(path, args.server_args, name)
                try:
                    warm_up(server.url, chat)
                    rates = {
                        w: rate(server.url, p, s, args.max_new_tokens) for w, (p, s) in workloads(chat, copy).items()
                    }
                finally:
                    server.stop()
                print(name, {k: round(v, 1) for k, v in rates.items()}, flush=True)
                rounds.setdefault(name, []).append(rates)
    print_configs(rounds)


def copy_prompt(model_path: str, tokens: int = 500, started: int = 16) -> str:
    """A chat prompt asking to repeat the first `tokens` tokens of PASSAGE, the answer begun with its first
    `started` tokens: a 135M model asked cold may answer something else (the bundled one starts writing code),
    which would measure chat, not copying; begun, it goes on copying."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = tokenizer(PASSAGE.read_text()).input_ids
    ask = f"Repeat the following text exactly, word for word:\n\n{tokenizer.decode(ids[:tokens])}"
    return chat_prompts(model_path, [ask])[0] + tokenizer.decode(ids[:started])


def workloads(chat: list[str], copy: str) -> dict[str, tuple[list[str], int]]:
    return {"chat x1": (chat, 1), "chat x16": (chat, 16), "copy x1": ([copy], 1)}


def rate(url: str, prompts: list[str], streams: int, max_new_tokens: int) -> float:
    return asyncio.run(run_load(url, prompts, streams, max_new_tokens)).decode_tokens_per_s


def start(path: str, server_args: str, name: str) -> KettleServer:
    """The configuration's server, started again once if its launcher stops while starting: on a shared machine,
    other jobs' clean-ups have sent it SIGINT, which is no measurement of ours."""
    items, flags = CONFIGS[name]
    flags = [*server_args.split(), *flags]
    # KettleServer adds the items to this process's own KETTLE_TUNING.
    env = {"KETTLE_TUNING": ",".join(f"{key}={value}" for key, value in items.items())} if items else {}
    try:
        return KettleServer(path, *flags, env=env)
    except RuntimeError as error:
        print(f"server start failed, trying again: {str(error).splitlines()[0]}", flush=True)
        return KettleServer(path, *flags, env=env)


def together(path: str, args: argparse.Namespace, names: list[str], chat: list[str], copy: str) -> dict:
    """Every configuration's server at once; each round runs every workload under each configuration in turn."""
    servers = {}
    try:
        for name in names:
            servers[name] = start(path, args.server_args, name)
            warm_up(servers[name].url, chat)
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        for round_ in range(args.rounds):
            rates: dict[str, dict[str, float]] = {name: {} for name in names}
            for workload, (prompts, streams) in workloads(chat, copy).items():
                for name in names if round_ % 2 == 0 else names[::-1]:
                    rates[name][workload] = rate(servers[name].url, prompts, streams, args.max_new_tokens)
            for name in names:
                print(name, {k: round(v, 1) for k, v in rates[name].items()}, flush=True)
                rounds[name].append(rates[name])
        return rounds
    finally:
        for server in servers.values():
            server.stop()


def in_process(path: str, args: argparse.Namespace, names: list[str], chat: list[str], copy: str) -> dict:
    """Each round runs every workload under each configuration in turn (the order reversed every other round)."""
    from transformers import AutoTokenizer

    from kettle.bench.drive import engine_run, shard_engine, tuning

    flags = argparse.ArgumentParser()
    flags.add_argument("--quantize")
    quantize = flags.parse_known_args(args.server_args.split())[0].quantize
    engine = shard_engine(path, 1024, quantize=quantize)
    tokenizer = AutoTokenizer.from_pretrained(path)
    encode = [tokenizer(text, add_special_tokens=False).input_ids for text in chat]
    loads = {"chat x1": encode[:1], "chat x16": [encode[i % len(encode)] for i in range(16)]}
    loads["copy x1"] = [tokenizer(copy, add_special_tokens=False).input_ids]
    engine.runner.speculate = 4
    engine_run(engine, loads["chat x16"][:2], 8)  # the first steps' one-time costs
    unset = dict.fromkeys(key for items, _ in CONFIGS.values() for key in items)
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        rates: dict[str, dict[str, float]] = {name: {} for name in names}
        for workload, prompts in loads.items():
            for name in names if round_ % 2 == 0 else names[::-1]:
                items, flags_ = CONFIGS[name]
                with tuning(unset | items):
                    engine.runner.speculate = 4 if "--speculate" in flags_ else 0
                    run = engine_run(engine, prompts, args.max_new_tokens, args.max_steps)
                rates[name][workload] = run.decode_rate
        for name in names:
            print(name, {k: round(v, 1) for k, v in rates[name].items()}, flush=True)
            rounds[name].append(rates[name])
    return rounds


def print_configs(rounds: dict[str, list[dict[str, float]]]) -> None:
    """Median tok/s per cell; beside it, the median over rounds of the ratio to `off` in the same round."""
    base = rounds.get("off")
    print("| config | chat x1 tok/s | chat x16 tok/s | copy x1 tok/s |\n|---|---|---|---|")
    for name, runs in rounds.items():
        cells = []
        for key in runs[0]:
            cell = f"{statistics.median(r[key] for r in runs):.1f}"
            if base is not None and name != "off":
                ratios = same_round([r[key] for r in runs], [b[key] for b in base])
                cell += f" ({statistics.median(ratios):.2f}x: " + ", ".join(f"{x:.2f}" for x in ratios) + ")"
            cells.append(cell)
        print(f"| {name} | " + " | ".join(cells) + " |")


# ---- LoRA ------------------------------------------------------------------------------------------------------

LORA = """What serving LoRA adapters costs: streams spread over 4 adapters against streams on the base model.

    .venv/bin/python -m bench lora                      # bundled model, rank 16, 16 streams, 3 rounds
    .venv/bin/python -m bench lora --quantize int4 --rounds 5
    .venv/bin/python -m bench lora --step               # one decode step in process: 16 rows, context 160
    .venv/bin/python -m bench lora --step --dtype-float32

Served (the default): one server (the bundled model, or --model-id) with 4 generated rank-R adapters on every
projection (q, k, v, o, gate, up, down). Each round runs the base-model batch and the adapters batch back to back
(the order alternates), so both see the same machine; the table gives each round's aggregate generated tok/s and
the median ratio. The adapters are random (B ~ N(0, 0.02)): their outputs are noise, their cost is real. A
request that stops early would leave a smaller batch behind and flatter the rate, so every request must run to
`--max-new-tokens` (a run where one stops early says so and stops).

`--step`: a decode step of `--streams` rows at `--context` on the model as served by default (`--quantize`, or
`--dtype-float32` for dense float32 weights), the three mixes interleaved in one process: every row on the base
model, rows spread over the 4 adapters, every row on one adapter; medians and their ratios to the base.
"""
PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def lora_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench lora", description=LORA, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-id", default=None)
    p.add_argument("--quantize", default=None)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--streams", type=int, default=16, help="requests in a batch (rows of --step's step)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="served rounds (--step: 15 timed steps)")
    p.add_argument("--step", action="store_true", help="one decode step in process instead (see above)")
    p.add_argument("--context", type=int, default=160, help="--step: tokens in the cache")
    p.add_argument("--dtype-float32", action="store_true", help="--step: dequantized float32 weights")
    return p


def lora(argv: list[str]) -> None:
    args = lora_parser().parse_args(argv)
    folder = Path(model_path(args.model_id))
    config = json.loads((folder / "config.json").read_text())
    root = Path(tempfile.mkdtemp(prefix="kettle-lora-bench-"))
    names = [f"a{i}" for i in range(4)]
    value = ",".join(f"{n}={write_adapter(root / n, config, args.rank, i)}" for i, n in enumerate(names))
    if args.step:
        return lora_step(args, folder, value)
    flags = ["--lora-adapters", value, *(["--quantize", args.quantize] if args.quantize else [])]
    server = KettleServer(args.model_id, *flags)
    try:
        base_batch = [None] * args.streams
        lora_batch = [{"adapter_id": names[i % len(names)]} for i in range(args.streams)]
        asyncio.run(run_load(server.url, [PROMPT], 4, 8, lora_batch[:4]))  # warm every adapter's path once
        rows = []
        for round_ in range(args.rounds):
            order = [("base", base_batch), ("lora", lora_batch)]
            measured = {}
            for label, batch in order if round_ % 2 == 0 else order[::-1]:
                result = asyncio.run(run_load(server.url, [PROMPT], args.streams, args.max_new_tokens, batch))
                fewest = min(len(s.arrivals) for s in result.streams)
                if fewest < args.max_new_tokens:
                    raise SystemExit(f"a request stopped after {fewest} tokens: the rates would not compare alike")
                measured[label] = result.tokens_per_s
            rows.append((measured["base"], measured["lora"]))
    finally:
        server.stop()
    print(f"{args.streams} streams, {args.max_new_tokens} new tokens, rank {args.rank}, quantize {args.quantize}")
    print("| round | base tok/s | 4 adapters tok/s | adapters / base |\n|---|---|---|---|")
    for i, (base, with_lora) in enumerate(rows):
        print(f"| {i + 1} | {base:.1f} | {with_lora:.1f} | {with_lora / base:.2f} |")
    print(f"ratio adapters / base: {ratio_summary([with_lora / base for base, with_lora in rows])}")


def lora_step(args: argparse.Namespace, folder: Path, adapters: str) -> None:
    import torch

    from kettle.bench.drive import SERVED_BLOCK_SIZE, new_cache
    from kettle.bench.timing import interleaved
    from kettle.layers.attention import AttentionMetadata
    from kettle.models.lora_adapters import load_adapters
    from kettle.models.registry import load_model

    model = load_model(str(folder), torch.float32, "cpu", quantize=args.quantize, dequantize=args.dtype_float32)
    load_adapters(adapters, model, 1)
    rows, block = args.streams, SERVED_BLOCK_SIZE
    per_row = args.context // block + 1
    cache = new_cache(model, rows * per_row + 1, block_size=block)
    tables = [list(range(1 + i * per_row, 1 + (i + 1) * per_row)) for i in range(rows)]

    def step(adapters: list[int]) -> None:
        meta = AttentionMetadata.build([1] * rows, [args.context] * rows, tables, block, "cpu")
        model.lora_rows.set(adapters, torch.device("cpu"))
        model.forward(torch.randint(0, 1000, (rows,)), meta.positions, cache, meta)

    mixes = {"base": [-1] * rows, "4 adapters": [i % 4 for i in range(rows)], "1 adapter": [0] * rows}
    fns = [lambda adapters=adapters: step(adapters) for adapters in mixes.values()]
    medians = [t.median for t in interleaved(fns, 15, warmup=3)]
    print(f"{rows} rows at context {args.context}, quantize {args.quantize}, float32 {args.dtype_float32}")
    for name, median in zip(mixes, medians, strict=True):
        print(f"{name}: median {median * 1000:.1f} ms ({median / medians[0]:.2f}x base)")


def write_adapter(folder: Path, config: dict, rank: int, seed: int) -> Path:
    """A PEFT-format LoRA checkpoint for `config`'s shapes, on every projection of every layer."""
    import torch
    from safetensors.torch import save_file

    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    inner = config["intermediate_size"]
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden)}
    shapes |= {"gate_proj": (hidden, inner), "up_proj": (hidden, inner), "down_proj": (inner, hidden)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for block, names in MODULES.items():
            for name in names:
                fan_in, fan_out = shapes[name]
                prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.02
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    targets = [n for names in MODULES.values() for n in names]
    peft = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": targets, "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(peft))
    return folder


MiB = 2**20

MEMORY = """The shard's resident memory apart from its KV cache: once ready, and after bursts of requests; llama.cpp's
beside it.

    .venv/bin/python -m bench memory [--runs 2] [--bursts 3] [-- LAUNCH FLAGS...]
    .venv/bin/python -m bench memory --schemes          # a process per weight scheme, loaded and decoding

Each run starts `kettle launch` as `make serve` does (the bundled model, no flags), twice in turn: as it ships and
with KETTLE_TUNING=release-library-pages=off (the library pages start-up ran kept resident). It reads the shard's VmRSS
from /proc minus its KV cache (the shard's `KV cache: ... MiB` line) when the shard has logged its memory, then
after each burst of 64 requests, 16 at a time (greedy and sampled, penalties, `top_n_tokens`, prompts of 10-200
tokens), and after one burst of JSON-schema requests (the first grammar builds llguidance's tokenizer view), each
read two seconds after the burst, when the idle shard has handed freed memory back. llama.cpp
(`llama_cpp.Llama`, n_ctx 8192, f16 KV cache) loads the same file and generates in a child process; its VmRSS
minus its KV cache is the comparable figure.

`--router`: the router's resident memory under prompts megabytes long. One server as `make serve` starts it, then
20 prompts of `--chars` characters (random words) one after another and 8 at once, each with `max_new_tokens` 10
(`--route`, /generate by default); without `--truncate` every one is over the token limits and answered 422.
Prints the router's RSS idle, at its highest and 10 s after each round: the memory the router keeps.

`--schemes`: for float32, int8 and int4 weights (`--quantize`), a fresh process loads the model, decodes a few
steps and reports its resident set while serving and its peak (VmRSS, VmHWM). The peak includes the checkpoint
file's pages while it is read, so "serving" is what the scheme itself changes.
"""

STARTUP = """Seconds from `kettle launch` to a healthy server, first with an empty Kettle cache, then with it filled.

    .venv/bin/python -m bench startup [--runs 2] [-- LAUNCH FLAGS...]

The first start prepares the model folder from the GGUF into the (temporary) cache; the later ones reuse it. The
C kernels come from the install (scripts/install.sh builds them into the environment); with
KETTLE_TUNING=installed-kernels=off the first start builds them into the cache as well, as a bare `pip install` would.
Each run prints its time, the launcher's log lines that say where the time went, and the resident memory each
process logged.
"""


# ---- memory ---------------------------------------------------------------------------------------------------

PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
SENTENCE = "the kettle boils water for tea while the rain falls on the quiet town by the sea"
WORDS = SENTENCE.split()


def memory_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench memory", description=MEMORY, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--runs", type=int, default=2, help="starts of each setting, in turn")
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--schemes", action="store_true", help="each weight scheme's process instead (see above)")
    p.add_argument("--router", action="store_true", help="the router's memory under huge prompts (see above)")
    p.add_argument("--chars", type=int, default=1_900_000, help="--router: characters of each prompt")
    p.add_argument("--truncate", type=int, help="--router: the requests' `truncate`")
    p.add_argument("--route", default="/generate", help="--router: the route the prompts go to")
    p.add_argument("--scheme-child", help=argparse.SUPPRESS)
    p.add_argument("flags", nargs="*", help="flags for `kettle launch` (after --)")
    return p


def memory(argv: list[str]) -> None:
    args = memory_parser().parse_args(argv)
    if args.scheme_child:
        return scheme_child(None if args.scheme_child == "float32" else args.scheme_child)
    if args.schemes:
        return schemes()
    if args.router:
        return router_memory(args)
    labels = ["ready", *(f"burst {i + 1}" for i in range(args.bursts)), "grammar"]
    print("MiB apart from the KV cache:", " | ".join(labels))
    from kettle.hub.resolve import bundled_gguf

    for run in range(args.runs):
        for release in (True, False):
            readings = kettle_memory(release, args.bursts, args.flags)
            name = "library pages released" if release else "release-library-pages=off"
            print(f"run {run + 1}, {name}:", " | ".join(f"{value:.1f}" for value in readings), flush=True)
        llama = llama_cpp_rest(str(bundled_gguf()))
        if llama is not None:
            rss, rest = llama
            print(f"run {run + 1}, llama.cpp (n_ctx 8192): VmRSS {rss:.1f}, apart from its KV cache {rest:.1f}")


def shard_rest(server: KettleServer) -> float:
    """The shard's VmRSS minus its KV cache, in MiB."""
    import psutil

    (shard,) = [p for p in psutil.Process(server.process.pid).children(recursive=True) if "serve" in p.cmdline()]
    kv = float(re.search(r"KV cache: .*?, ([0-9.]+) MiB\)", Path(server.log.name).read_text()).group(1))
    return shard.memory_info().rss / MiB - kv


def burst_parameters(seed: int, grammar: bool, n: int) -> tuple[list[str], list[dict]]:
    """`n` requests' prompts (10-200 words) and parameters: greedy and sampled, penalties, top tokens, grammars."""
    rng = random.Random(seed)
    prompts, parameters = [], []
    for i in range(n):
        prompts.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 200))))
        each = {"do_sample": i % 2 == 0, "seed": i}
        each |= {"repetition_penalty": 1.1} if i % 3 == 0 else {}
        each |= {"top_n_tokens": 3, "top_p": 0.9} if i % 4 == 0 else {}
        each |= {"grammar": {"type": "json", "value": PERSON_SCHEMA}} if grammar else {}
        parameters.append(each)
    return prompts, parameters


def burst(url: str, seed: int, grammar: bool = False, n: int = 64, concurrency: int = 16) -> None:
    """`n` requests of 32 tokens, `concurrency` at a time."""
    prompts, parameters = burst_parameters(seed, grammar, n)
    for at in range(0, n, concurrency):
        group = slice(at, at + concurrency)
        asyncio.run(run_load(url, prompts[group], len(prompts[group]), 32, parameters[group]))


def kettle_memory(release: bool, bursts: int, flags: list[str]) -> list[float]:
    server = KettleServer(None, *flags, env={"KETTLE_TUNING": f"release-library-pages={'on' if release else 'off'}"})
    try:
        server.wait_for_log("Resident memory of shard-0")
        readings = [shard_rest(server)]
        for seed, grammar, n in [*((seed, False, 64) for seed in range(bursts)), (99, True, 16)]:
            burst(server.url, seed, grammar, n)
            time.sleep(2)  # the idle shard hands freed memory back after a second
            readings.append(shard_rest(server))
    finally:
        server.stop()
    return readings


def router_rss(server: KettleServer) -> int:
    import psutil

    (router,) = [p for p in psutil.Process(server.process.pid).children(recursive=True) if "router" in p.cmdline()]
    return router.memory_info().rss


async def router_round(server: KettleServer, bodies: list[dict], at_once: bool, route: str) -> tuple[int, set[int]]:
    """Sends the bodies (in turn, or all at once); returns the router's highest RSS meanwhile and the statuses."""
    import httpx

    highest = router_rss(server)

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
    return highest, {response.status_code for response in responses}


def router_memory(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    parameters = {"max_new_tokens": 10} | ({"truncate": args.truncate} if args.truncate else {})
    server = KettleServer(None, *args.flags)
    try:
        time.sleep(3)
        print(f"idle: {router_rss(server) / MiB:.0f} MiB", flush=True)
        for count, at_once in ((20, False), (8, True)):
            prompts = [" ".join(rng.choice(WORDS) for _ in range(args.chars // 4))[: args.chars] for _ in range(count)]
            bodies = [{"inputs": prompt, "parameters": parameters} for prompt in prompts]
            started = time.monotonic()
            highest, statuses = asyncio.run(router_round(server, bodies, at_once, args.route))
            took = time.monotonic() - started
            time.sleep(10)
            how = "at once" if at_once else "in a row"
            print(f"{count} {how} ({took:.1f} s, statuses {sorted(statuses)}): highest {highest / MiB:.0f} MiB, "
                  f"10 s after {router_rss(server) / MiB:.0f} MiB", flush=True)  # fmt: skip
    finally:
        server.stop()


LLAMA_CPP = """
import json, sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=8192, n_threads=2, verbose=False)
for seed in range(3):
    llm("the kettle boils water for tea while the rain falls", max_tokens=32, seed=seed)
meta = llm.metadata
arch = meta["general.architecture"]
layers, width = int(meta[f"{arch}.block_count"]), int(meta[f"{arch}.embedding_length"])
heads = int(meta[f"{arch}.attention.head_count"])
kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
kv = llm.n_ctx() * layers * 2 * kv_heads * (width // heads) * 2  # K and V, float16
rss = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
print(json.dumps({"rss": rss, "kv": kv}))
"""


def llama_cpp_rest(model: str) -> tuple[float, float] | None:
    """llama.cpp's VmRSS and the part of it that is not its KV cache, in MiB; None where it is not installed."""
    try:
        out = subprocess.run([sys.executable, "-c", LLAMA_CPP, model], capture_output=True, text=True, check=True)
    except subprocess.CalledProcessError as error:
        print("llama.cpp not measured:", error.stderr.strip().splitlines()[-1:])
        return None
    answer = json.loads(out.stdout.splitlines()[-1])
    return answer["rss"] / MiB, (answer["rss"] - answer["kv"]) / MiB


def status_mib(field: str) -> float:
    """A memory line of /proc/self/status (VmRSS: resident now, VmHWM: its peak) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def scheme_child(quantize: str | None) -> None:
    """In the child: load the bundled model under `quantize`, a few decode steps, then the resident memory in MiB."""
    import torch

    from kettle.bench.drive import DecodeLoop
    from kettle.hub.resolve import resolve_model
    from kettle.models.registry import load_model

    loaded = status_mib("VmRSS")
    path = str(resolve_model(None).path)  # float32: dense weights (the bundled GGUF's dequantized)
    model = load_model(path, torch.float32, torch.device("cpu"), quantize=quantize, dequantize=quantize is None)
    loop = DecodeLoop(model, 1, 32, 8)
    for _ in range(4):
        loop()
    print(json.dumps({"before_load": loaded, "serving": status_mib("VmRSS"), "peak": status_mib("VmHWM")}))


def schemes() -> None:
    root = Path(__file__).resolve().parents[1]
    for scheme in ("float32", "int8", "int4"):
        command = [sys.executable, "-m", "bench", "memory", "--scheme-child", scheme]
        out = subprocess.run(command, check=True, capture_output=True, text=True, cwd=root).stdout
        mib = json.loads(out.strip().splitlines()[-1])
        print(f"RSS {scheme:7s}: serving {mib['serving']:7.1f} MiB, peak {mib['peak']:7.1f} MiB "
              f"(runtime before loading: {mib['before_load']:.1f} MiB)")  # fmt: skip


# ---- startup --------------------------------------------------------------------------------------------------

# The log lines that say where the start-up time went.
TELLING = re.compile(
    r"Convert|Model .* ready|shard\(s\) ready|Warming up|warmed up|Loading weights|Resident memory|Serving"
)


def startup_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench startup", description=STARTUP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--runs", type=int, default=2, help="starts in all: the first with an empty cache")
    p.add_argument("flags", nargs="*", help="flags for `kettle launch` (after --)")
    return p


def startup(argv: list[str]) -> None:
    args = startup_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kettle-cache-") as cache:
        for run in range(args.runs):
            started = time.monotonic()
            flags = ["--prometheus-port", "0", *args.flags]
            server = KettleServer(None, *flags, env={"KETTLE_CACHE": cache}, timeout=900, max_kv_tokens=None, poll=0.1)
            seconds = time.monotonic() - started
            server.stop(timeout=120)
            lines = [line for line in Path(server.log.name).read_text().splitlines() if TELLING.search(line)]
            print(f"{'empty cache' if run == 0 else 'cache filled'}: healthy after {seconds:.1f} s")
            for line in lines:
                print("   ", line)
