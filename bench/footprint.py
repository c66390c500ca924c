"""What serving costs besides speed: resident memory (`memory`) and the time to start (`startup`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kettle.bench.loadgen import run_load
from kettle.bench.process import KettleServer

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

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
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
        each |= {"grammar": {"type": "json", "value": SCHEMA}} if grammar else {}
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
