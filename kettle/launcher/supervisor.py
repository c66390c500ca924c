"""The supervisor: start the shards and the router, wait until the shards answer, then watch all of them.

Any child that exits takes the whole server down at once with a log line naming it (never a half-alive
server, never a hang); SIGINT/SIGTERM stop the router first, so it stops taking requests while the shards
can still finish the running ones, then the shards. A second signal kills whatever is left immediately.
"""

from __future__ import annotations

import logging
import signal
import time

from kettle.launcher.child import Child, stop_children
from kettle.launcher.sockets import SocketInUse, answers, clear_stale, remove
from kettle.launcher.specs import ProcessSpec
from kettle.process_memory import log_resident_memory

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1
# After a crash the other children have nothing left to finish: do not give them the full graceful timeout.
FAILURE_STOP_SECONDS = 5.0
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# The router drains for up to the graceful timeout, then closes its connections and the shard channels: it gets
# this much longer before it is killed, so a drain that uses its whole time still ends cleanly.
ROUTER_EXIT_MARGIN = 10.0


def clear_sockets(specs: list[ProcessSpec]) -> None:
    """Removes the stale sockets of `specs` before they start; raises SocketInUse where a live server holds one."""
    for spec in specs:
        if spec.socket:
            clear_stale(spec.socket)


class Supervisor:
    """Runs one server: shard processes and the router, until a signal or a child's exit."""

    def __init__(
        self,
        shards: list[ProcessSpec],
        router: ProcessSpec | None,
        graceful_timeout: float = 90.0,
        start_timeout: float = 600.0,
        router_exit_margin: float = ROUTER_EXIT_MARGIN,
        started: list[Child] | None = None,
        started_router: Child | None = None,
    ) -> None:
        """`started`: the shards' processes where the launcher started them already (`shards`' specs, their stale
        sockets cleared), else the supervisor starts them; `started_router` likewise the router's."""
        self.shard_specs = shards
        self.started = started
        self.router_spec = router
        self.started_router = started_router
        self.graceful_timeout = graceful_timeout
        self.start_timeout = start_timeout
        self.router_exit_margin = router_exit_margin
        self.shards: list[Child] = []
        self.router: Child | None = None
        self._signals: list[int] = []

    def run(self) -> int:
        """Blocks until the server stops; returns 0 after a requested shutdown, 1 after a failure."""
        previous = {signum: signal.signal(signum, self._on_signal) for signum in HANDLED_SIGNALS}
        code = 1
        try:
            code = self._start_and_watch()
        finally:
            if code == 0:
                self._stop_all(self.graceful_timeout, router_margin=self.router_exit_margin)
            else:
                self._stop_all(min(self.graceful_timeout, FAILURE_STOP_SECONDS))
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return code

    def _on_signal(self, signum: int, _frame: object) -> None:
        # Only record it: the loops below act on it (logging inside a signal handler can deadlock).
        self._signals.append(signum)

    def _forced(self) -> bool:
        return len(self._signals) > 1

    def _start_and_watch(self) -> int:
        if self.started is not None:
            self.shards = self.started
        else:
            try:
                clear_sockets(self.shard_specs)
            except SocketInUse as error:
                log.error("%s", error)
                return 1
            self.shards = [Child(spec) for spec in self.shard_specs]
        if self.router_spec is not None:  # None: a --node-rank > 0 host runs shards only
            # Started beside the shards, not after them: its imports and tokenizers (~2 s here) load while they
            # load the model, and it waits for rank 0's socket before it asks anything.
            self.router = self.started_router or Child(self.router_spec)
        code = self._wait_for_shards()
        if code is not None:
            return code
        # Everything is started: the launcher holds what it will hold until shutdown (the model resolution is done).
        log_resident_memory(log, "launcher")
        return self._watch()

    def _wait_for_shards(self) -> int | None:
        """None once every shard answers on its socket; otherwise the exit code to stop with."""
        deadline = time.monotonic() + self.start_timeout
        pending = [child for child in self.shards if child.spec.socket]
        while True:
            if self._signals:
                log.info("Received %s while starting: shutting down", signal.Signals(self._signals[0]).name)
                return 0
            dead = self._first_exited(self._children())
            if dead is not None:
                log.error("%s %s before the shards were ready; shutting down", dead.name, dead.describe_exit())
                return 1
            pending = [child for child in pending if not answers(child.spec.socket)]
            if not pending:
                log.info("%d shard(s) ready", len(self.shards))
                return None
            if time.monotonic() > deadline:
                names = ", ".join(f"{child.name} ({child.spec.socket})" for child in pending)
                log.error("No answer within %.0f s from %s; shutting down", self.start_timeout, names)
                return 1
            time.sleep(POLL_SECONDS)

    def _watch(self) -> int:
        children = self._children()
        while True:
            if self._signals:
                log.info("Received %s: shutting down", signal.Signals(self._signals[0]).name)
                return 0
            dead = self._first_exited(children)
            if dead is not None:
                log.error("%s %s; shutting down", dead.name, dead.describe_exit())
                return 1
            time.sleep(POLL_SECONDS)

    def _children(self) -> list[Child]:
        """The shards and, where this host runs one, the router."""
        return [*self.shards, *([self.router] if self.router else [])]

    @staticmethod
    def _first_exited(children: list[Child]) -> Child | None:
        return next((child for child in children if child.exit_code() is not None), None)

    def _stop_all(self, timeout: float, router_margin: float = 0.0) -> None:
        """The router first (it drains: running requests finish, new ones get 503), then all shards together."""
        if self.router is not None:
            stop_children([self.router], timeout + router_margin, self._forced)
        if not self.shards:
            return  # nothing started: the sockets, if any, belong to someone else
        stop_children(self.shards, timeout, self._forced)
        for spec in self.shard_specs:
            if spec.socket:
                remove(spec.socket)
        log.info("All processes stopped")
