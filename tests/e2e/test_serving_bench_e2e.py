"""`python -m bench serving` on the CPU: the tiny random model served at concurrency 1 and 4 and all at once, and
transformers' batched generate beside it; every answer runs to its requested length and the figures are sane."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.serving import load, scaled

ROOT = Path(__file__).resolve().parents[2]


def test_the_serving_benchmark_forces_every_length_and_reports_each_row(tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    argv = [sys.executable, "-m", "bench", "serving", "--model", "tiny", "--device", "cpu", "--concurrency", "1,4"]
    argv += ["--requests", "8", "--max-input", "64", "--max-output", "24", "--floor-requests", "4"]
    # A small KV pool, so the few blocks these requests hold are a visible fraction of it.
    argv += ["--kv-tokens", "4096", "--sample-every", "0.01", "--checkpoint", str(tmp_path / "model")]
    argv += ["--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's kettle, in the server's processes too
    result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    for line in ("| kettle | c=1 | 4 |", "| kettle | c=4 | 8 |", "| kettle | offline | 8 |"):
        assert line in result.stdout, result.stdout
    assert "| transformers | offline, batches of 4 | 4 |" in result.stdout
    assert "answers not of their requested length (or failed): 0" in result.stdout

    rows = {(row["engine"], row["workload"]): row for row in json.loads(out.read_text())["rows"]}
    mix = scaled(load(), 64, 24)
    asked = {"c=1": mix[:4], "c=4": mix[:8], "offline": mix[:8]}
    for workload, requests in asked.items():
        row = rows["kettle", workload]
        assert row["short"] == [] and row["requests"] == len(requests)
        assert row["output_tokens"] == sum(r.output_tokens for r in requests)
        assert row["output_tok_s"] > 0 and row["requests_s"] > 0
        assert 0 < row["ttft_p50"] <= row["ttft_p99"]
        assert 0 < row["itl_p50"] <= row["itl_p99"]
        assert row["kv_samples"] > 0 and 0 <= row["kv_mean"] <= row["kv_peak"] <= 1
        if row["concurrency"] > 1:
            assert row["kv_peak"] > 0, row
    floor = rows["transformers", "offline, batches of 4"]
    assert floor["short"] == [] and floor["output_tokens"] == sum(r.output_tokens for r in mix[:4])
    assert floor["output_tok_s"] > 0
