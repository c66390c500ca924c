"""Kettle vs the engines a user would pick instead, on the same model, prompts and greedy settings, in one run.

    make bench-peers                                  # installs ctranslate2 + llama-cpp-python into .venv, runs this
    .venv/bin/python bench/peers.py                   # 128 new tokens, 1 and 16 streams, 1 and 2 threads
    .venv/bin/python bench/peers.py --max-new-tokens 32 --streams 1 --threads 1     # a quick check
    .venv/bin/python bench/peers.py --threads 2 --engines ctranslate2,llama.cpp,kettle --rounds 5

Engines: transformers `generate` (fp32; 16 streams = one batch of 16), CTranslate2 int8 (the bundled model
converted once with its transformers converter), llama.cpp through llama-cpp-python on the bundled GGUF (batch 1
only: its Python API decodes one sequence), and Kettle over HTTP (bf16/fp32 as it serves by default, and with
`--quantize int4` and `int8`). Each peer runs in its own subprocess at each `--threads` count; the table keeps
each engine's fastest. An engine whose package is missing is skipped with a line saying so. Prompts are
compare.py's, rendered with the chat template; stream i gets prompt i. decode tok/s is measured the way
kettle.bench.loadgen does: the tokens after each stream's first, over the time from the first first-token to the
last token. With `--rounds N` every engine is measured N times, the engines' order reversed every other round
(so drift on a shared machine hits them alike): the table shows each configuration's median, and each round's
ratios of Kettle to the peers it is compared with (llama.cpp at one stream, CTranslate2 at 16) are printed with
their median.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from compare import chat_prompts

PEER_PACKAGES = {"transformers": "transformers", "ctranslate2": "ctranslate2", "llama.cpp": "llama_cpp"}
# llama-cpp-python's high-level API decodes one sequence at a time, so it gets no batched row.
SINGLE_STREAM_ONLY = {"llama.cpp"}
ENGINES = ("transformers", "ctranslate2", "llama.cpp", "kettle", "kettle-int4", "kettle-int8")
LABELS = {
    "transformers": "transformers generate (fp32)",
    "ctranslate2": "CTranslate2 (int8)",
    "llama.cpp": "llama.cpp (GGUF Q4_1)",
    "kettle": "kettle",
    "kettle-int4": "kettle --quantize int4",
    "kettle-int8": "kettle --quantize int8",
}


@dataclass(frozen=True)
class Row:
    """One measured configuration: an engine at a thread count and a number of concurrent streams."""

    engine: str
    threads: int
    streams: int
    decode: float


def decode_rate(arrivals: list[list[float]]) -> float:
    """Tokens after each stream's first, over first first-token to last token (as loadgen.LoadResult does)."""
    decoded = sum(len(a) - 1 for a in arrivals)
    span = max(a[-1] for a in arrivals) - min(a[0] for a in arrivals)
    return decoded / span if span > 0 else float("nan")


# ---- workers: each runs in its own subprocess, prints one JSON line with its decode rate --------------------


def transformers_worker(model_path: str, prompts: list[str], max_new_tokens: int) -> list[list[float]]:
    """One left-padded batch through fp32 greedy `generate`; a streamer timestamps every step."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    class StepClock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.prompt_seen = False

        def put(self, value) -> None:  # the first call carries the prompt, every later one a step's tokens
            if self.prompt_seen:
                self.times.append(time.perf_counter())
            self.prompt_seen = True

        def end(self) -> None:
            pass

    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    from kettle.hub.resolve import float_folder

    model = AutoModelForCausalLM.from_pretrained(float_folder(model_path), dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    clock = StepClock()
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, streamer=clock)
    rows = out[:, batch.input_ids.shape[1] :].tolist()
    # A finished row is padded while others go on; it counts its tokens up to and including its EOS.
    lengths = [next((i + 1 for i, t in enumerate(row) if t in eos), len(row)) for row in rows]
    return [clock.times[:n] for n in lengths]


def ctranslate2_worker(model_path: str, prompts: list[str], max_new_tokens: int, threads: int) -> list[list[float]]:
    """One int8 `generate_batch` (greedy); its per-token callback timestamps each stream's tokens."""
    import ctranslate2
    from transformers import AutoTokenizer

    generator = ctranslate2.Generator(
        str(ct2_model(model_path)), device="cpu", compute_type="int8", intra_threads=threads, inter_threads=1
    )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokens = [tokenizer.convert_ids_to_tokens(tokenizer(p).input_ids) for p in prompts]
    arrivals: list[list[float]] = [[] for _ in prompts]
    generator.generate_batch(
        tokens,
        max_length=max_new_tokens,
        sampling_topk=1,
        beam_size=1,
        include_prompt_in_result=False,
        callback=lambda step: record(arrivals[step.batch_id]),
    )
    return arrivals


def record(arrivals: list[float]) -> bool:
    """Timestamps a token; False tells CTranslate2 to go on decoding."""
    arrivals.append(time.perf_counter())
    return False


def ct2_model(model_path: str) -> Path:
    """The bundled model converted to CTranslate2 int8, once, under the Kettle cache (reused by later runs)."""
    from ctranslate2.converters import TransformersConverter

    from kettle.hub.cache import build_once, cache_root
    from kettle.hub.gguf import GGUF_LINK
    from kettle.hub.resolve import float_folder

    # A GGUF folder's name ends with its file's key, so the conversion records that file: once it is gone (a
    # deleted virtual environment's bundled model), the next conversion here removes this one.
    link = Path(model_path) / GGUF_LINK
    sources = [link.resolve()] if link.exists() else []
    target = cache_root() / "peers" / f"ct2-int8-{Path(model_path).name}"
    converter = TransformersConverter(str(float_folder(model_path)))

    def convert(out: Path) -> None:
        converter.convert(str(out), quantization="int8", force=True)

    return build_once(target, convert, "CTranslate2 int8", sources)


def llama_cpp_worker(prompts: list[str], max_new_tokens: int, threads: int) -> list[list[float]]:
    """Greedy llama.cpp on the bundled GGUF, the one prompt of a single stream."""
    from llama_cpp import Llama

    from kettle.hub.resolve import bundled_gguf

    llm = Llama(model_path=str(bundled_gguf()), n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False)
    (prompt,) = prompts
    ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    arrivals: list[float] = []
    for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        arrivals.append(time.perf_counter())
        if token == llm.token_eos() or len(arrivals) >= max_new_tokens:
            break
    return [arrivals]


def run_worker(args: argparse.Namespace) -> None:
    """Child side: a short warm-up call, then the timed one; prints {"decode": tok/s}."""
    if args.worker == "transformers":
        import torch

        torch.set_num_threads(args.threads)
    model_path = bundled_model_path()
    rendered = chat_prompts(model_path)
    prompts = [rendered[i % len(rendered)] for i in range(args.worker_streams)]  # as loadgen.run_load
    workers = {
        "transformers": lambda n: transformers_worker(model_path, prompts, n),
        "ctranslate2": lambda n: ctranslate2_worker(model_path, prompts, n, args.threads),
        "llama.cpp": lambda n: llama_cpp_worker(prompts, n, args.threads),
    }
    workers[args.worker](4)
    print(json.dumps({"decode": decode_rate(workers[args.worker](args.max_new_tokens))}))


# ---- parent: spawns the peers and Kettle servers, prints the table -------------------------------------------


def bundled_model_path() -> str:
    from kettle.hub.resolve import resolve_model

    return str(resolve_model(None).path)


def peer_rows(engine: str, threads: list[int], streams: list[int], max_new_tokens: int) -> list[Row]:
    """One subprocess per (threads, streams); OMP_NUM_THREADS pins the libraries' own pools too."""
    rows = []
    for t in threads:
        for s in [s for s in streams if s == 1 or engine not in SINGLE_STREAM_ONLY]:
            argv = [sys.executable, __file__, "--worker", engine, "--threads", str(t), "--worker-streams", str(s)]
            argv += ["--max-new-tokens", str(max_new_tokens)]
            env = {**os.environ, "OMP_NUM_THREADS": str(t)}
            done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
            if done.returncode != 0:
                print(f"{engine} threads={t} streams={s} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            rows.append(Row(engine, t, s, json.loads(done.stdout.strip().splitlines()[-1])["decode"]))
            print(f"  {engine} threads={t} streams={s}: {rows[-1].decode:.1f} tok/s", file=sys.stderr)
    return rows


def kettle_rows(name: str, flags: list[str], threads: list[int], streams: list[int], max_new_tokens: int) -> list[Row]:
    """One launcher per thread count (`--num-threads`), measured with loadgen at each concurrency."""
    from kettle.bench.loadgen import measure
    from kettle.bench.process import KettleServer

    model_path = bundled_model_path()
    prompts = chat_prompts(model_path)
    rows = []
    for t in threads:
        server = KettleServer(model_path, "--max-concurrent-requests", "256", "--num-threads", str(t), *flags)
        try:
            results = measure(server.url, prompts, streams, max_new_tokens)
        finally:
            server.stop()
        for s, result in results.items():
            rows.append(Row(name, t, s, result.decode_tokens_per_s))
            print(f"  {name} threads={t} streams={s}: {rows[-1].decode:.1f} tok/s", file=sys.stderr)
    return rows


def fastest(rows: list[Row]) -> list[Row]:
    """Each (engine, streams) at its fastest thread count, in first-seen order."""
    best: dict[tuple[str, int], Row] = {}
    for row in rows:
        key = (row.engine, row.streams)
        if key not in best or row.decode > best[key].decode:
            best[key] = row
    return list(best.values())


def medians(rounds: list[list[Row]]) -> list[Row]:
    """Each (engine, threads, streams) at its median decode rate over the rounds, in first-seen order."""
    runs: dict[tuple[str, int, int], list[float]] = {}
    for row in (row for rows in rounds for row in rows):
        runs.setdefault((row.engine, row.threads, row.streams), []).append(row.decode)
    return [Row(*key, statistics.median(rates)) for key, rates in runs.items()]


# Kettle's single stream against llama.cpp's, its 16 streams against CTranslate2's batch.
COMPARED = ((1, "llama.cpp"), (16, "ctranslate2"))


def print_ratios(rounds: list[list[Row]]) -> None:
    """Per round, Kettle (default flags) over each compared peer at the same streams (fastest thread counts)."""
    for streams, peer in COMPARED:
        ratios = []
        for rows in rounds:
            best = {(r.engine, r.streams): r.decode for r in fastest(rows)}
            if ("kettle", streams) in best and (peer, streams) in best:
                ratios.append(best["kettle", streams] / best[peer, streams])
        if ratios:
            each = ", ".join(f"{r:.2f}" for r in ratios)
            print(f"kettle / {LABELS[peer]} at {streams} stream(s): median {statistics.median(ratios):.2f}x ({each})")


def print_table(rows: list[Row], max_new_tokens: int) -> None:
    baseline = next((r.decode for r in rows if r.engine == "transformers" and r.streams == 1), None)
    print(f"\nmodel: {bundled_model_path()}\nmax_new_tokens={max_new_tokens}, greedy, chat-templated prompts\n")
    print("| engine | threads | streams | decode tok/s | vs transformers b=1 |")
    print("|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r.decode / baseline:.2f}x" if baseline else "-"
        print(f"| {LABELS[r.engine]} | {r.threads} | {r.streams} | {r.decode:.1f} | {ratio} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, from {', '.join(ENGINES)}")
    parser.add_argument("--streams", default="1,16", help="concurrent streams (a batch for the peers)")
    parser.add_argument("--threads", default="1,2", help="thread counts tried per engine; the fastest is shown")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="measure every engine this many times; medians")
    parser.add_argument("--worker", choices=list(PEER_PACKAGES), help=argparse.SUPPRESS)
    parser.add_argument("--worker-streams", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.threads = int(args.threads)
        return run_worker(args)
    unknown = set(args.engines.split(",")) - set(ENGINES)
    if unknown:
        parser.error(f"unknown engine(s) {', '.join(sorted(unknown))}; choose from {', '.join(ENGINES)}")
    engines = args.engines.split(",")
    for engine in [e for e in engines if not e.startswith("kettle")]:
        if importlib.util.find_spec(PEER_PACKAGES[engine]) is None:
            print(f"skipped {engine}: `{PEER_PACKAGES[engine]}` is not installed (`make bench-peers` installs it)")
            engines.remove(engine)
    rounds = []
    for i in range(args.rounds):
        print(f"round {i + 1} of {args.rounds}", file=sys.stderr)
        rounds.append([row for engine in engines[:: -1 if i % 2 else 1] for row in measure_engine(engine, args)])
    print_table(fastest(medians(rounds)), args.max_new_tokens)
    print()
    print_ratios(rounds)


def measure_engine(engine: str, args: argparse.Namespace) -> list[Row]:
    """One engine's rows: Kettle through its server (with `--quantize` for the kettle-int4/int8 entries), a peer
    through its workers."""
    streams, threads = [int(x) for x in args.streams.split(",")], [int(x) for x in args.threads.split(",")]
    if engine.startswith("kettle"):
        flags = ["--quantize", engine.removeprefix("kettle-")] if engine != "kettle" else []
        return kettle_rows(engine, flags, threads, streams, args.max_new_tokens)
    return peer_rows(engine, threads, streams, args.max_new_tokens)


if __name__ == "__main__":
    main()
