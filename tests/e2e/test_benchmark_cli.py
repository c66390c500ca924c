"""`kettle benchmark` starts its own shard on the tiny model and prints its latency and throughput tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

KETTLE = str(Path(sys.executable).parent / "kettle")


def test_benchmark_prints_latency_and_throughput_tables(tiny_llama_path):
    argv = [KETTLE, "benchmark", "--model-id", str(tiny_llama_path), "--batch-size", "1", "--batch-size", "2"]
    argv += ["--sequence-length", "8", "--decode-length", "4", "--runs", "2", "--warmups", "1"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "| step | batch | avg ms |" in out
    for step in ("prefill", "decode token", "decode total"):
        assert f"| {step} | 1 |" in out and f"| {step} | 2 |" in out
    rows = [line for line in out.splitlines() if line.startswith("| 2 |")]
    assert rows, out
    prefill_tps, decode_tps, bandwidth = (float(x) for x in rows[-1].strip("| ").split(" | ")[1:])
    assert prefill_tps > 0 and decode_tps > 0 and bandwidth > 0
