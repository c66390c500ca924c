"""Single-stream decode over HTTP against the bare decode step, alternated in one run.

    .venv/bin/python bench/served_vs_bare.py                       # bundled model, `make serve`'s defaults
    .venv/bin/python bench/served_vs_bare.py --rounds 3 --max-new-tokens 64
    .venv/bin/python bench/served_vs_bare.py --engine              # also the shard engine in this process

Method: one server started as `make serve` starts it (no flags, its own subprocesses), and in this process the
same model folder loaded as a shard loads it (default scheme and KV cache dtype). Each round streams
kettle.bench.loadgen's chat prompts to the server one after another (decode tok/s: the tokens after each
stream's first over the time from its first token to its last, summed over the streams; the gaps between
requests, prefills and connection set-up, are left out as the bare step has none), then runs the bare step:
`--max-new-tokens` greedy decode steps of one sequence after a prompt of the same length as the served ones
(metadata build + forward + logits + argmax, as bench/model_decode.py times it), tok/s = steps / their time.
The two never run at once (the idle side sleeps), and each round's ratio served / bare is printed with the
median over the rounds: the target is within 10% (a ratio of 0.9 or more).

`--engine` adds, each round, the shard's engine driven in this process as the router drives it (no server):
the same steps after the same prompt length in Decode calls of up to 8 steps (a settled router's window for
one stream), first with greedy windows (kettle/shard/greedy_window.py) and then without
(`KETTLE_GREEDY_WINDOW=0`), each as a ratio to the bare step: what the engine adds or saves, with no router or
client on the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch
from model_decode import kettle_decode

from kettle.bench.loadgen import chat_prompts, run_load
from kettle.bench.process import KettleServer
from kettle.hub import resolve_model
from kettle.models.registry import load_model


def bare_decode(model, prompt_tokens: int, steps: int) -> float:
    """tok/s of `steps` greedy one-sequence decode steps after a `prompt_tokens` prompt, on a fresh cache (in the
    shard's default KV dtype), as bench/model_decode.py runs them."""
    step = kettle_decode(model, 1, prompt_tokens, steps)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return steps / (time.perf_counter() - start)


def engine_decode(engine, prompt_tokens: int, steps: int, window: bool, request_id: int) -> float:
    """tok/s of one greedy request's `steps` decode steps on the shard engine, in Decode calls of up to 8 steps,
    with greedy windows on or off."""
    import os

    from kettle import settings
    from kettle.proto import generate_pb2 as pb

    os.environ["KETTLE_GREEDY_WINDOW"] = "1" if window else "0"
    settings.reload()
    batch = pb.Batch(id=request_id)
    request = batch.requests.add(id=request_id, input_ids=list(range(100, 100 + prompt_tokens)))
    request.stopping_parameters.max_new_tokens = steps + 1
    request.stopping_parameters.ignore_eos_token = True
    request.blocks.extend(range(-(-(prompt_tokens + steps + 1) // 16)))
    answer = engine.prefill(pb.PrefillRequest(batch=batch))
    start, tokens = time.perf_counter(), 0
    while answer.HasField("batch"):
        answer = engine.decode(pb.DecodeRequest(batches=[answer.batch], max_steps=8))
        tokens += sum(len(g.tokens.ids) for g in answer.generations)
    return tokens / (time.perf_counter() - start)


def warm_engine(path):
    """The shard's engine over `path` as a shard builds it (default scheme and KV dtype), warmed up."""
    from kettle.proto import generate_pb2 as pb
    from kettle.shard.config import ShardConfig
    from kettle.shard.server import build_engine

    engine, _ = build_engine(ShardConfig(model_path=str(path)))
    warm = pb.WarmupRequest(max_input_tokens=512, max_prefill_tokens=512, max_total_tokens=512)
    warm.batch.requests.add(id=0, input_ids=[1, 2, 3]).stopping_parameters.max_new_tokens = 1
    engine.warmup(warm)
    return engine


def stream_decode_rate(results) -> float:
    """Tokens after each stream's first over the sum of the streams' first-to-last-token spans."""
    streams = [s for result in results for s in result.streams]
    return sum(len(s.arrivals) - 1 for s in streams) / sum(s.arrivals[-1] - s.arrivals[0] for s in streams)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="the bare step's threads (the shard's default: all)")
    parser.add_argument("--engine", action="store_true", help="also the shard engine in process (see above)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(None).path
    prompts = chat_prompts(path)[:3]
    model = load_model(path, torch.float32, "cpu")
    prompt_tokens = 48  # about the chat prompts' rendered length
    engine = warm_engine(path) if args.engine else None
    server = KettleServer(None)
    ratios, engine_ratios = [], {True: [], False: []}
    try:
        asyncio.run(run_load(server.url, prompts[:1], 1, 16))  # warm-up: the first request's one-off costs
        bare_decode(model, prompt_tokens, 16)
        # The shard faults its KV cache in behind the warm-up (kettle/tensors/zeroed_memory.py: 0.5-4.5 s here);
        # first rounds started without waiting measured 0.44-0.47 where the others gave 0.9-1.1.
        time.sleep(6)
        for r in range(args.rounds):
            # One prompt after another: a single stream at a time (run_load with one stream takes the first only).
            loads = [asyncio.run(run_load(server.url, [prompt], 1, args.max_new_tokens)) for prompt in prompts]
            served = stream_decode_rate(loads)
            bare = bare_decode(model, prompt_tokens, args.max_new_tokens)
            ratios.append(served / bare)
            line = f"round {r + 1}: served {served:.1f} tok/s, bare {bare:.1f}, ratio {ratios[-1]:.2f}"
            for window in (True, False) if engine is not None else ():
                rate = engine_decode(engine, prompt_tokens, args.max_new_tokens, window, 100 + 2 * r + window)
                engine_ratios[window].append(rate / bare)
                line += f"; engine {'with' if window else 'without'} windows {rate:.1f} ({rate / bare:.2f})"
            print(line, flush=True)
    finally:
        server.stop()
    print(f"median ratio served / bare: {statistics.median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)})")
    for window, values in engine_ratios.items():
        if values:
            listed = ", ".join(f"{x:.2f}" for x in values)
            name = "with" if window else "without"
            print(f"median ratio engine {name} windows / bare: {statistics.median(values):.3f} ({listed})")


if __name__ == "__main__":
    main()
