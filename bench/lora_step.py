"""A decode step with LoRA rows against the same step on the base model, in one process (no HTTP, no EOS).

    .venv/bin/python bench/lora_step.py                  # bundled model as served by default, 16 rows, context 160
    .venv/bin/python bench/lora_step.py --quantize int4  # or int8; --dtype-float32 for dense float32 weights

Four generated rank-16 adapters on every projection (bench/lora_throughput.py writes them). The three mixes run
interleaved, 15 times each after a warm-up: every row on the base model, rows spread over the 4 adapters, every
row on one adapter. Prints the median step time of each and its ratio to the base.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from lora_throughput import write_adapter

from kettle.hub.resolve import resolve_model
from kettle.layers.attention import AttentionMetadata
from kettle.models.lora_adapters import load_adapters
from kettle.models.registry import load_model
from kettle.tensors.kv_cache import KVCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantize", default=None)
    parser.add_argument("--dtype-float32", action="store_true", help="dequantized float32 weights")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--context", type=int, default=160)
    args = parser.parse_args()
    folder = resolve_model(None).path
    config = json.loads((folder / "config.json").read_text())
    root = Path(tempfile.mkdtemp(prefix="kettle-lora-step-"))
    value = ",".join(f"a{i}={write_adapter(root / f'a{i}', config, 16, i)}" for i in range(4))
    model = load_model(str(folder), torch.float32, "cpu", quantize=args.quantize, dequantize=args.dtype_float32)
    load_adapters(value, model, 1)
    spec, rows, block = model.spec, args.rows, 16
    per_row = args.context // block + 1
    cache = KVCache(spec.num_layers, rows * per_row + 1, block, spec.num_kv_heads, spec.head_dim, spec.dtype, "cpu")
    tables = [list(range(1 + i * per_row, 1 + (i + 1) * per_row)) for i in range(rows)]

    def step(adapters: list[int]) -> float:
        meta = AttentionMetadata.build([1] * rows, [args.context] * rows, tables, block, "cpu")
        model.lora_rows.set(adapters, torch.device("cpu"))
        start = time.perf_counter()
        with torch.inference_mode():
            model.forward(torch.randint(0, 1000, (rows,)), meta.positions, cache, meta)
        return time.perf_counter() - start

    mixes = {"base": [-1] * rows, "4 adapters": [i % 4 for i in range(rows)], "1 adapter": [0] * rows}
    times: dict[str, list[float]] = {name: [] for name in mixes}
    for round_ in range(18):
        for name, adapters in mixes.items():
            seconds = step(adapters)
            if round_ >= 3:
                times[name].append(seconds)
    base = statistics.median(times["base"])
    print(f"{rows} rows at context {args.context}, quantize {args.quantize}, float32 {args.dtype_float32}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name}: median {median * 1000:.1f} ms ({median / base:.2f}x base)")


if __name__ == "__main__":
    main()
