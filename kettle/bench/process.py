"""Starts the real launcher (`kettle launch`) on a free port (for benchmarks and end-to-end tests) and stops it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

from kettle import settings

KETTLE = str(Path(sys.executable).parent / "kettle")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, name: str, logs, timeout: float, poll: float = 0.5) -> bool:
    """Polls `url`/health until it answers 200 (True) or `timeout` passes (False); raises if `process` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{logs()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(poll)
    return False


def child_environment(env: Mapping[str, str], max_kv_tokens: int | None) -> dict[str, str]:
    """This process's environment with `env` over it, but KETTLE_TUNING item by item, as separate variables were:
    this process's items, then `max_kv_tokens` as max-kv-tokens (None: none), then `env`'s own items."""
    child = {**os.environ, **env}
    cap: dict[str, object] = {"max-kv-tokens": max_kv_tokens} if max_kv_tokens is not None else {}
    given = settings.tuning_items(env.get(settings.TUNING_VARIABLE, ""))
    if cap or settings.TUNING_VARIABLE in child:
        child[settings.TUNING_VARIABLE] = settings.merge_tuning(os.environ.get(settings.TUNING_VARIABLE), cap | given)
    return child


class KettleServer:
    """A launcher process serving one model on 127.0.0.1; `url` is its base address."""

    def __init__(
        self,
        model_id: str | None,
        *flags: str,
        env: dict[str, str] | None = None,
        timeout: float = 300,
        hostname: str | None = "127.0.0.1",
        own_sockets: bool = True,
        max_kv_tokens: int | None = 65536,
        poll: float = 0.5,
        cwd: str | None = None,
    ) -> None:
        """`hostname=None` leaves --hostname out (the launcher's default, or HOSTNAME from `env`);
        `own_sockets=False` leaves the shard socket path to the launcher's default instead of a private folder;
        `max_kv_tokens` caps the KV cache (KETTLE_TUNING's max-kv-tokens; None: no cap of ours, sized as `make
        serve` sizes it; `child_environment`); /health is polled every `poll` seconds until it answers; `cwd`: the
        launcher's working directory (a tree's own, so that a tree from before the launcher ran its children from its
        own package still does: their `python -m` put the working directory first on their path)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.flags = flags
        self.uds = os.path.join(tempfile.mkdtemp(prefix="kettle-test-"), "shard") if own_sockets else None
        argv = [KETTLE, "launch", "--port", str(self.port)]
        argv += ["--hostname", hostname] if hostname else []
        argv += ["--model-id", model_id] if model_id else []  # no --model-id: the bundled model
        argv += ["--shard-uds-path", self.uds] if self.uds else []
        argv += flags
        # The log outlives this call (the launcher writes to it until stopped), so no context manager here.
        self.log = tempfile.NamedTemporaryFile(prefix="kettle-e2e-", suffix=".log", delete=False)  # noqa: SIM115
        child_env = child_environment(env or {}, max_kv_tokens)
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=child_env, cwd=cwd)
        self._wait_ready(timeout, poll)

    def _wait_ready(self, timeout: float, poll: float = 0.5) -> None:
        if wait_healthy(self.url, self.process, "launcher", self.logs, timeout, poll):
            return
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.logs()}")

    def logs(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-6000:]

    def wait_for_log(self, text: str, timeout: float = 60) -> None:
        """Returns once `text` is in the server's log (anywhere in it); TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while text not in Path(self.log.name).read_text(errors="replace"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{text!r} not logged within {timeout} s:\n{self.logs()}")
            time.sleep(0.1)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, as an orchestrator would; returns the launcher's exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode
