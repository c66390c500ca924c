"""The HTTP load generator against the real server: its table has one row per concurrency with sane numbers."""

from __future__ import annotations

import re

from kettle.bench.loadgen import markdown_table, measure


def test_load_table_reports_prefill_and_decode_rates_per_concurrency(tiny_server):
    results = measure(tiny_server.url, ["Hello world! How are you today?", "The capital of France is"], [1, 3], 6)
    assert [len(r.streams) for r in results.values()] == [1, 3]
    for result in results.values():
        assert all(s.prompt_tokens > 0 and len(s.arrivals) >= 1 for s in result.streams)
        summary = result.summary()
        assert summary["prefill tok/s"] > 0 and summary["ttft p50"] <= summary["ttft p99"]
    lines = markdown_table(results).splitlines()
    assert lines[0].startswith("| method | streams | prefill tok/s | decode tok/s | TTFT p50 ms | TTFT p99 ms |")
    assert [line.split("|")[2].strip() for line in lines[2:]] == ["1", "3"]
    assert all(re.fullmatch(r"\| kettle \| \d+ (\| (\d+\.\d|nan) ){6}\|", line) for line in lines[2:])
