"""A supervised child process: started in its own process group, tied to the launcher's life.

Own process group: Ctrl-C in a terminal signals the whole foreground group at once, which would stop the
shards while the router still serves; with their own groups only the launcher gets it and stops the
children in order. Tied to the launcher: on Linux each child asks the kernel (PR_SET_PDEATHSIG) to SIGKILL
it when the launcher dies, so even `kill -9` of the launcher leaves no orphan holding a port or a socket.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from kettle.launcher.specs import ProcessSpec

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


def _start_hook(niceness: int) -> Callable[[], None] | None:
    """A preexec_fn that makes the child die with the launcher and lowers its CPU priority by `niceness`, or None off
    Linux.

    libc and the parent pid are looked up here, before fork: between fork and exec only simple calls are safe.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        # The launcher may have died between fork and prctl; then nobody would ever send the signal.
        if os.getppid() != parent:
            os._exit(1)
        if niceness > 0:
            with contextlib.suppress(OSError):  # refused (a sandbox): the child says so (router/priority.py)
                os.nice(niceness)

    return hook


class Child:
    """A running child process and the handful of operations the supervisor needs on it."""

    def __init__(self, spec: ProcessSpec, reads_stdin: bool = False) -> None:
        """Starts `spec`; with `reads_stdin` its stdin is a pipe from the launcher (`tell`), else empty."""
        self.spec = spec
        self.process = subprocess.Popen(
            list(spec.argv),
            env=dict(spec.env),
            stdin=subprocess.PIPE if reads_stdin else subprocess.DEVNULL,
            process_group=0,
            preexec_fn=_start_hook(spec.niceness),
        )
        log.info("Started %s (pid %d)", self.name, self.pid)

    @property
    def name(self) -> str:
        return self.spec.name

    def tell(self, line: str) -> None:
        """Writes one line to the child's stdin and closes it (a child started with `reads_stdin`); a child that has
        exited already is left to the supervisor, which reports it."""
        with contextlib.suppress(BrokenPipeError, OSError):
            self.process.stdin.write(f"{line}\n".encode())
            self.process.stdin.close()

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_code(self) -> int | None:
        """None while running; the exit code, or minus the signal number that killed it."""
        return self.process.poll()

    def describe_exit(self) -> str:
        code = self.process.returncode
        if code is not None and code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def signal_group(self, signum: int) -> None:
        """Signals the child's whole process group, so anything it started goes too."""
        if self.exit_code() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signum)

    def wait_until(self, deadline: float, interrupted: Callable[[], bool] = lambda: False) -> bool:
        """Waits for the exit until `deadline` (monotonic) or `interrupted()`; True if it exited."""
        while self.exit_code() is None:
            if time.monotonic() >= deadline or interrupted():
                return False
            time.sleep(0.05)
        return True


def stop_children(children: list[Child], timeout: float, interrupted: Callable[[], bool] = lambda: False) -> None:
    """SIGTERM to all of `children` at once, then SIGKILL to those still running after `timeout` seconds."""
    running = [child for child in children if child.exit_code() is None]
    for child in running:
        log.info("Stopping %s (pid %d)", child.name, child.pid)
        child.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for child in running:
        if not child.wait_until(deadline, interrupted):
            log.warning("%s still running after SIGTERM: killing it", child.name)
            child.signal_group(signal.SIGKILL)
            child.process.wait()
    for child in children:
        # Reap the whole group, also when the leader exited on its own before we signalled it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
