"""Reads a running server's KV block pool and block ledger from /metrics."""

from __future__ import annotations

import re
import time

import httpx


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(rf"^{name}(?:_total)? ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def assert_pool_whole(url: str, timeout: float = 10) -> None:
    """Every KV block is free again (cancelled requests are dropped at the next step, so allow a moment) and the
    block ledger never went out of balance."""
    deadline = time.monotonic() + timeout
    while metric(url, "kettle_kv_blocks_free") != metric(url, "kettle_kv_blocks_total"):
        assert time.monotonic() < deadline, "KV blocks leaked"
        time.sleep(0.1)
    assert metric(url, "kettle_kv_ledger_violations") == 0
