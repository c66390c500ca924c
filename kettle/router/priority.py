"""The router's CPU priority: `router-nice` below the shards'."""

from __future__ import annotations

import contextlib
import logging
import os

import psutil

logger = logging.getLogger("kettle.router.server")


def yield_cpu(niceness: int, launcher_pid: int | None = None) -> None:
    """Makes this process's CPU priority `niceness` lower than the launcher's (`launcher_pid`; started by hand, than
    its own), before any thread starts, so all of them inherit it.

    The shards' threads fill the cores while a step runs; the router's work (the next call, the streams' events)
    then took a core from a running step, and its partner threads waited at the step's next barrier: twice the
    router's time lost. At a lower priority the router runs more in the step's idle moments instead (docs/
    performance.md: a few percent at one stream on 2 cores, within that machine's noise at 16). Where a core is
    free it changes nothing. The launcher starts the router at that priority already (`ProcessSpec.niceness`), so
    that its imports (~0.7 s of a core) are low priority too: on a first start they run beside the model's
    preparation, which the start waits for. Here it is checked, and set where that did not happen."""
    if niceness <= 0:
        return
    current, base = os.nice(0), None
    if launcher_pid is not None:
        with contextlib.suppress(psutil.Error):
            base = psutil.Process(launcher_pid).nice()
    target = min((current if base is None else base) + niceness, 19)
    if current < target:
        try:
            os.nice(target - current)
        except OSError as exc:  # a sandbox may refuse it; the router only runs at the shards' priority then
            logger.warning(
                "Could not lower the router's CPU priority (KETTLE_TUNING=router-nice=%d): %s", niceness, exc
            )
            return
    logger.info(
        "Router niceness +%d: the shards' compute goes first on a busy CPU (KETTLE_TUNING's router-nice)", niceness
    )
