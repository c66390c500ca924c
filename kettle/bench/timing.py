"""The benchmarks' one timing helper: calls run interleaved, round by round, and each one's median and minimum.

On a shared CPU, timing one variant after the other measures the neighbours as much as the code; run in turn
(a, b, a, b, ...) every variant sees the same machine load. The median is the figure the benchmarks quote; the
minimum (the fastest call) is what a kernel micro-benchmark quotes, where even the median measures the
neighbours. Ratios are taken round by round (`same_round`), so a drift of the machine between rounds cancels.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    """Seconds of each timed call of one function, in the order they ran."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def minimum(self) -> float:
        return min(self.samples)


def wall_seconds(fn: Callable[[], object]) -> float:
    """Seconds one call of `fn` takes on the wall clock (the default measure)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(
    fns: Sequence[Callable[[], object]],
    rounds: int,
    warmup: int = 1,
    measure: Callable[[Callable[[], object]], float] = wall_seconds,
) -> list[Timing]:
    """Each function's timings over `rounds` rounds, every round calling each once in turn, after `warmup` untimed
    rounds. `measure` times one call (a GPU benchmark passes one reading CUDA events)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, times in zip(fns, samples, strict=True):
            times.append(measure(fn))
    return [Timing(tuple(times)) for times in samples]


def same_round(values: Sequence[float], baseline: Sequence[float]) -> list[float]:
    """Each round's value over the baseline's of the same round."""
    return [v / b for v, b in zip(values, baseline, strict=True)]


def ratio_summary(ratios: Sequence[float]) -> str:
    """ "1.23x (1.20, 1.31, 1.23)": the median of same-round ratios, then each round's."""
    return f"{statistics.median(ratios):.2f}x ({', '.join(f'{r:.2f}' for r in ratios)})"
