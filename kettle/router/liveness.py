"""Liveness of the batching loop: /health must not say 200 while the scheduler makes no progress.

A wedged loop (a shard call that never returns, a step stuck on a bug, blocks that leaked so nothing can be
admitted, a loop task that died) leaves every request hanging while the shards still answer their own health
checks. So the loop beats whenever a step did work, and when work arrives at an idle server; when work is queued
or running and no beat came for longer than the bound, /health answers 503 and logs why. Steps that find nothing
they can run do not beat: a queue that never moves is a stall too. The bound adapts to the slowest step seen (a
long prefill on a big model is not a stall): `max(timeout, 4 x slowest step)`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

SLOW_STEP_FACTOR = 4.0


class Liveness:
    """The loop's heartbeat and the stall rule /health applies to it."""

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self._clock = clock
        self._beat = clock()
        self._started: float | None = None  # the step in progress began then
        self._slowest = 0.0

    def step_started(self) -> None:
        self._started = self._clock()

    def step_ended(self, busy: bool) -> None:
        """`busy`: the step ran a forward (or failed trying): progress."""
        now = self._clock()
        if busy and self._started is not None:
            self._slowest = max(self._slowest, now - self._started)
            self._beat = now
        self._started = None

    def work_arrived(self) -> None:
        """The first request reached a server that had nothing to do: the stall clock starts now."""
        self._beat = self._clock()

    @property
    def bound(self) -> float:
        return max(self.timeout, SLOW_STEP_FACTOR * self._slowest)

    def stall(self, has_work: bool) -> str | None:
        """Why the loop counts as stalled, or None while it is alive (or has nothing to do)."""
        if self._started is None and not has_work:
            return None
        silent = self._clock() - self._beat
        if silent <= self.bound:
            return None
        where = "inside one step" if self._started is not None else "while requests wait"
        return f"the scheduler made no progress for {silent:.1f} s {where} (bound {self.bound:.1f} s)"
