"""How many decode steps the next Decode call may run on the shards.

Every call costs a round trip: the gRPC call, the shard's thread hand-off, the router's update. On a small CPU
that is ~1 ms against a ~4 ms single-stream step, time in which both cores do nothing for the model. When the
running batch is settled (nothing waits in the queue, no prompt is half prefilled, no client has gone), the
shards may run several steps in one call and answer them together, so the round trip is paid once per window.

`DecodeSteps` keeps a moving average of one decode step's time, measured on the calls the scheduler runs, and
allows as many steps as fit in `window_s` (at most `MAX_STEPS`). Tokens of one call reach the streams together,
so the window bounds how bursty a stream gets and how long a newcomer waits before its prefill. A window of 0
turns it off: one step per call, as TGI does.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_STEPS = 16
_SMOOTHING = 0.25  # weight of the newest measurement in the moving average


@dataclass
class DecodeSteps:
    """The step count of the next decode call, learned from the time of the previous ones."""

    window_s: float
    step_s: float | None = None  # moving average of one decode step

    def steps(self, settled: bool) -> int:
        """Steps the next call may run; `settled`: no request waits to join and none needs the router between
        steps (a prompt chunk to come, a cancellation to apply)."""
        if not settled or self.window_s <= 0 or self.step_s is None:
            return 1
        return max(1, min(MAX_STEPS, int(self.window_s / self.step_s)))

    def observe(self, seconds: float, steps: int) -> None:
        """Learns from one decode call: its wall time and the steps it ran."""
        if steps >= 1:
            per_step = seconds / steps
            self.step_s = per_step if self.step_s is None else (1 - _SMOOTHING) * self.step_s + _SMOOTHING * per_step
