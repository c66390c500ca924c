"""The real launcher supervising real children: a dead shard stops the whole server, non-zero and fast."""

from __future__ import annotations

import os
import signal
import time

import psutil

from kettle.bench.process import KettleServer


def _shard_pids(launcher_pid: int) -> list[int]:
    children = psutil.Process(launcher_pid).children(recursive=True)
    return [c.pid for c in children if " serve " in " ".join(c.cmdline())]


def test_a_killed_shard_stops_the_launcher_within_seconds(tiny_llama_path):
    server = KettleServer(str(tiny_llama_path))
    children = psutil.Process(server.process.pid).children(recursive=True)
    shards = _shard_pids(server.process.pid)
    assert len(shards) == 1, [c.cmdline() for c in children]
    started = time.monotonic()
    os.kill(shards[0], signal.SIGKILL)
    try:
        code = server.process.wait(30)
    finally:
        server.stop()
    assert code != 0
    assert time.monotonic() - started < 30
    assert "shard" in server.logs().lower()
    gone = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not gone, f"orphans left: {[c.cmdline() for c in gone]}"
    assert not os.path.exists(f"{server.uds}-0"), "stale socket left behind"


def test_the_router_runs_at_a_lower_cpu_priority_than_the_shards(tiny_server):
    """The router yields the CPU to the shards (KETTLE_ROUTER_NICE, 10 by default): every one of its threads is
    10 nicer than the launcher, the shard keeps the launcher's priority."""
    launcher = psutil.Process(tiny_server.process.pid)
    children = launcher.children(recursive=True)
    (router,) = [c for c in children if " router " in " ".join(c.cmdline())]
    (shard,) = [c for c in children if c.pid in _shard_pids(launcher.pid)]
    assert shard.nice() == launcher.nice()
    threads = [psutil.Process(t.id) for t in router.threads()]
    assert len(threads) > 1 and all(t.nice() == launcher.nice() + 10 for t in threads)
