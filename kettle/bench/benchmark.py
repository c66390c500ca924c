"""`kettle benchmark`: drives a shard directly over gRPC and prints latency and throughput tables.

For each batch size it sends requests of exactly `sequence_length` random prompt tokens, times one prefill
and `decode_length` decode steps (EOS ignored), over `runs` runs after `warmups`, and prints markdown tables.
Beside tokens/s it prints the weight bandwidth a decode step achieves (weight bytes ÷ step time): decode is
memory-bandwidth bound, so this says how far from the machine's limit we are. Its configuration
(`BenchmarkConfig`, every flag of the command, checked at construction) and the weight bytes a step reads
(`weight_bytes`) live here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import safe_open
from tqdm import tqdm

import kettle
from kettle.proto import generate_pb2 as pb
from kettle.router.client import ShardedClient

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class BenchmarkConfig:
    """What to measure and against which shard.

    With `master_shard_uds_path` the benchmark drives an already running shard; without it, it starts its
    own shard on `model_id` (resolved like `kettle launch --model-id`) and stops it at the end. The
    model's tokenizer builds the prompts either way.
    """

    model_id: str | None = None  # Hub id, local folder or .gguf; None: the bundled model
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    sequence_length: int = 10  # prompt tokens per request, exactly
    decode_length: int = 8  # decode steps timed per run, EOS ignored
    runs: int = 10
    warmups: int = 1
    master_shard_uds_path: str | None = None  # a running shard's rank-0 socket
    dtype: str | None = None  # of the shard the benchmark starts; None: the device's default
    quantize: str | None = None  # `--quantize` of the shard the benchmark starts

    def __post_init__(self) -> None:
        if not self.batch_sizes:
            raise ValueError("--batch-size needs at least one value")
        if any(size < 1 for size in self.batch_sizes):
            raise ValueError("--batch-size values must be >= 1")
        for name in ("sequence_length", "decode_length", "runs"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.warmups < 0:
            raise ValueError("--warmups must be >= 0")


# ---- weight bytes: the numerator of a decode step's achieved bandwidth ----------------------------------------

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Bytes a weight occupies under `--quantize` (int4: a nibble plus a float16 scale and minimum per group of 64);
# the LM head and tied embedding are int8 under both (KETTLE_QUANT_LM_HEAD's default).
_QUANTIZED_BYTES = {"int8": 1.0, "int4": 0.5 + 4 / 64, "gptq": 0.5 + 4 / 64, "awq": 0.5 + 4 / 64}


def parameter_count(model_path: Path) -> int:
    """Parameters in the folder's safetensors files (tied weights stored once are counted once)."""
    total = 0
    for file in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                total += _numel(f.get_slice(name).get_shape())
    return total


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def weight_bytes(model_path: Path, dtype: str, quantize: str | None = None) -> int:
    """Bytes of weights at the served dtype (every weight is read once per decode step); under `--quantize`
    int8/int4/gptq/awq the 2-D projection weights count at their quantized width, the LM head at int8."""
    if quantize not in _QUANTIZED_BYTES:
        return parameter_count(model_path) * _BYTES.get(dtype, 4)
    total = 0.0
    for file in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                shape = f.get_slice(name).get_shape()
                head = "embed" in name or "lm_head" in name or "wte" in name
                width = 1.0 if head else _QUANTIZED_BYTES[quantize] if len(shape) == 2 else _BYTES.get(dtype, 4)
                total += _numel(shape) * width
    return int(total)


@dataclass
class Samples:
    """Timings (seconds) of one batch size over all runs."""

    prefill: list[float] = field(default_factory=list)
    decode_token: list[float] = field(default_factory=list)
    decode_total: list[float] = field(default_factory=list)


def _batch(batch_id: int, size: int, config: BenchmarkConfig, vocab_size: int, block_size: int) -> pb.Batch:
    rng = random.Random(batch_id)
    per_request = -(-(config.sequence_length + config.decode_length) // block_size)
    batch = pb.Batch(id=batch_id, size=size)
    for i in range(size):
        ids = [rng.randrange(3, vocab_size) for _ in range(config.sequence_length)]
        request = batch.requests.add(id=batch_id * 1000 + i, input_ids=ids)
        request.parameters.CopyFrom(pb.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0))
        request.stopping_parameters.max_new_tokens = config.decode_length
        request.stopping_parameters.ignore_eos_token = True
        request.blocks.extend(range(i * per_request, (i + 1) * per_request))
    return batch


async def _one_run(client: ShardedClient, batch: pb.Batch, samples: Samples | None) -> None:
    start = time.perf_counter()
    _gens, cached, _t = await client.prefill(batch)
    prefill = time.perf_counter() - start
    steps = []
    while cached is not None:
        step = time.perf_counter()
        _gens, cached, _t = await client.decode([cached])
        steps.append(time.perf_counter() - step)
    if samples is not None:
        samples.prefill.append(prefill)
        samples.decode_token.extend(steps)
        samples.decode_total.append(sum(steps))


async def _bench(client: ShardedClient, config: BenchmarkConfig) -> dict[int, Samples]:
    info = await client.info()
    largest = max(config.batch_sizes)
    total = config.sequence_length + config.decode_length
    await client.warmup(config.sequence_length, config.sequence_length * largest, total, largest)
    results: dict[int, Samples] = {}
    progress = tqdm(total=len(config.batch_sizes) * (config.runs + config.warmups), desc="benchmark", unit="run")
    for size in config.batch_sizes:
        results[size] = Samples()
        for run in range(config.warmups + config.runs):
            batch = _batch(run + 1, size, config, info.vocab_size, info.block_size)
            await _one_run(client, batch, results[size] if run >= config.warmups else None)
            progress.update()
    progress.close()
    return results


def _stats(values: list[float]) -> list[float]:
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))]

    return [statistics.fmean(values), ordered[0], ordered[-1], pct(0.5), pct(0.9), pct(0.99)]


def render(results: dict[int, Samples], config: BenchmarkConfig, model_bytes: int) -> str:
    """The markdown tables: latency (ms) per phase, then throughput and achieved weight bandwidth."""
    lines = [
        "| step | batch | avg ms | min ms | max ms | p50 ms | p90 ms | p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, attr in (("prefill", "prefill"), ("decode token", "decode_token"), ("decode total", "decode_total")):
        for size, samples in results.items():
            cells = " | ".join(f"{v * 1000:.2f}" for v in _stats(getattr(samples, attr)))
            lines.append(f"| {name} | {size} | {cells} |")
    lines += ["", "| batch | prefill tok/s | decode tok/s | decode weight GB/s |", "|---|---|---|---|"]
    for size, samples in results.items():
        prefill = size * config.sequence_length / statistics.median(samples.prefill)
        step = statistics.median(samples.decode_token)
        lines.append(f"| {size} | {prefill:.1f} | {size / step:.1f} | {model_bytes / step / 1e9:.2f} |")
    return "\n".join(lines)


@contextlib.contextmanager
def _own_shard(config: BenchmarkConfig) -> Iterator[str]:
    """Starts a shard process for `config.model_id` when no running shard was given; yields its socket."""
    if config.master_shard_uds_path:
        yield config.master_shard_uds_path
        return
    from kettle.hub import resolve_model

    path = str(resolve_model(config.model_id).path)
    uds = os.path.join(tempfile.mkdtemp(prefix="kettle-bench-"), "shard")
    argv = [*kettle.python_command("kettle.cli"), "serve", path, "--uds-path", uds]
    argv += ["--dtype", config.dtype] if config.dtype else []
    argv += ["--quantize", config.quantize] if config.quantize else []
    shard = subprocess.Popen(
        argv, env={**os.environ, "PYTHONPATH": kettle.child_pythonpath(os.environ.get("PYTHONPATH"))}
    )
    try:
        yield f"{uds}-0"
    finally:
        shard.terminate()
        shard.wait(30)


async def _main(config: BenchmarkConfig, uds: str) -> str:
    client = await ShardedClient.connect(uds, timeout=600)
    try:
        results = await _bench(client, config)
        info = await client.info()
    finally:
        await client.close()
    model_path = config.model_id
    if not model_path or not Path(model_path).is_dir():
        from kettle.hub import resolve_model

        model_path = str(resolve_model(config.model_id).path)
    return render(results, config, weight_bytes(Path(model_path), info.dtype, config.quantize))


def run(config: BenchmarkConfig) -> None:
    """Runs the benchmark and prints the tables."""
    with _own_shard(config) as uds:
        print(asyncio.run(_main(config, uds)))
