"""Kettle replicas behind vllm-router for the scaling tests: start, measure, kill, stop.

vllm-router is the `scale` extra (`pip install kettle[scale]`); `make test` installs it. Where it is missing the
tests that need it are skipped.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import psutil

from kettle.bench.process import KettleServer, free_port, wait_healthy

ROUTER = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")


class Router:
    """vllm-router on loopback in front of `workers`, with one routing `policy`."""

    def __init__(self, workers: list[str], policy: str, timeout: float = 60) -> None:
        assert ROUTER is not None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_port = free_port()
        argv = [ROUTER, "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy]
        argv += ["--worker-urls", *workers, "--prometheus-port", str(self.metrics_port)]
        # Fast health checks, so a dead replica leaves the rotation within a few seconds.
        argv += ["--health-check-interval-secs", "1", "--health-failure-threshold", "1"]
        self.log = tempfile.NamedTemporaryFile(prefix="vllm-router-", suffix=".log", delete=False)  # noqa: SIM115
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        if wait_healthy(self.url, self.process, "vllm-router", self.logs, timeout, poll=0.2):
            return
        self.stop()
        raise TimeoutError(f"vllm-router not healthy after {timeout}s:\n{self.logs()}")

    def logs(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def metric(server: KettleServer, name: str) -> float:
    """One unlabelled sample of a replica's /metrics (0 when absent)."""
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "_total "):
            return float(line.split()[-1])
    return 0.0


def kill_hard(server: KettleServer) -> None:
    """SIGKILL the launcher and every process under it, as a node or OOM kill would: no graceful stop."""
    launcher = psutil.Process(server.process.pid)
    family = [launcher, *launcher.children(recursive=True)]
    for process in family:
        process.kill()
    psutil.wait_procs(family, timeout=10)
    server.process.wait()
