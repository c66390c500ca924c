"""The real launcher supervising real children: a dead shard stops the whole server, non-zero and fast."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import httpx
import psutil

from kettle.bench.process import KETTLE, KettleServer, free_port


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
    """The router yields the CPU to the shards (KETTLE_TUNING's router-nice, 10 by default): every one of its threads is
    10 nicer than the launcher, the shard keeps the launcher's priority."""
    launcher = psutil.Process(tiny_server.process.pid)
    children = launcher.children(recursive=True)
    (router,) = [c for c in children if " router " in " ".join(c.cmdline())]
    (shard,) = [c for c in children if c.pid in _shard_pids(launcher.pid)]
    assert shard.nice() == launcher.nice()
    threads = [psutil.Process(t.id) for t in router.threads()]
    assert len(threads) > 1 and all(t.nice() == launcher.nice() + 10 for t in threads)


def test_a_first_start_starts_the_shards_and_the_router_beside_the_models_preparation(tmp_path):
    """With an empty cache the bundled GGUF's folder takes seconds to prepare: the shards and the router start
    meanwhile (their imports overlap it), get the folder from the launcher once it is ready, and serve; the router
    reports the model under the name the user gave, as when it starts after the preparation."""
    server = KettleServer(None, env={"KETTLE_CACHE": str(tmp_path / "cache")})
    try:
        logs = server.logs()
        ready = logs.index("Model HuggingFaceTB/SmolLM2-135M-Instruct ready")
        assert logs.index("Started shard-0") < ready and logs.index("Started router") < ready
        told = f"Model folder from the launcher: {tmp_path / 'cache'}"
        assert re.search(f"kettle.shard.server: {told}", logs) and re.search(f"kettle.router.server: {told}", logs)
        assert httpx.get(f"{server.url}/info").json()["model_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
        answer = httpx.post(f"{server.url}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
        assert answer.status_code == 200 and answer.json()["generated_text"]
    finally:
        assert server.stop() == 0


def test_stopping_during_the_preparation_stops_the_shards_started_beside_it(tmp_path):
    log = tmp_path / "launcher.log"
    argv = [KETTLE, "launch", "--port", str(free_port()), "--shard-uds-path", str(tmp_path / "s")]
    env = {**os.environ, "KETTLE_CACHE": str(tmp_path / "cache")}
    with open(log, "w") as out:
        launcher = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    while "Starting the shards while the model is prepared" not in log.read_text() or not _shard_pids(launcher.pid):
        assert time.monotonic() < deadline and launcher.poll() is None, log.read_text()
        time.sleep(0.05)
    children = psutil.Process(launcher.pid).children(recursive=True)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(60) == 130, log.read_text()
    assert "Stopped while preparing the model" in log.read_text()
    gone = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not gone, f"orphans left: {[c.cmdline() for c in gone]}"
