"""Progress of what a user waits for at start-up (downloads, weight loading, warm-up): a tqdm bar on a terminal,
a log line at every tenth of the way everywhere else.

Everywhere else means a redirected stderr (a container's log, a file) or `--json-output`: a bar there would be
one endless line of carriage returns, or text in the middle of JSON lines, so those get `LoggedProgress`, which
draws nothing and logs through the process's logging setup (JSON lines carry the numbers as fields). Updates
are counted, never drawn or logged one by one, so a bar costs nothing per tensor worth measuring.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

from tqdm import tqdm

from kettle.logging_setup import json_output_enabled

log = logging.getLogger("kettle.progress")

STEP_PERCENT = 10
# LoggedProgress stays silent this long (seconds): what ends sooner (a cached download, a small model's weights)
# was not worth a line.
QUIET_SECONDS = 2.0
# A terminal bar redraws at most this often (seconds): cheap even for thousands of tiny updates.
MIN_INTERVAL = 0.5


def bars_shown() -> bool:
    """Whether this process draws bars: stderr is a terminal and the log is text."""
    return not json_output_enabled() and sys.stderr.isatty()


def progress_bar(total: int | None, desc: str, unit: str = "it", enabled: bool = True, **extra: Any) -> tqdm:
    """A bar over `total` units (a terminal bar or `LoggedProgress`, as `bars_shown()` says); `enabled=False`
    (e.g. on every tensor-parallel rank but the first) gives one that shows nothing."""
    if not enabled:
        return tqdm(total=total, desc=desc, unit=unit, disable=True)
    if bars_shown():
        return tqdm(total=total, desc=desc, unit=unit, mininterval=MIN_INTERVAL, dynamic_ncols=True, **extra)
    return LoggedProgress(total=total, desc=desc, unit=unit, **extra)


class _Discard:
    """Where LoggedProgress's (never drawn) bar goes."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


class LoggedProgress(tqdm):
    """A tqdm that draws nothing and logs a line each time another `STEP_PERCENT` of its total is done, once it
    has run for `QUIET_SECONDS`.

    It accepts tqdm's arguments, so libraries that take a `tqdm_class` (huggingface_hub's downloads) use it as
    they would a bar; a total that grows while it runs (huggingface_hub learns sizes as files start) is fine.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["file"] = _Discard()
        # Counting must go on with no terminal (tqdm's `disable=None` would turn it off); only an explicit True
        # (the library's own "no progress" setting) silences it.
        kwargs["disable"] = kwargs.get("disable") is True
        kwargs["mininterval"] = float("inf")  # nothing to redraw
        self._logged_percent = 0
        self._log_lock = threading.Lock()
        self._closed = False
        super().__init__(*args, **kwargs)

    def update(self, n: float | None = 1) -> bool | None:
        shown = super().update(n)
        if self.total and not self.disable and self._time() - self.start_t >= QUIET_SECONDS:
            percent = min(100, int(100 * self.n / self.total)) // STEP_PERCENT * STEP_PERCENT
            with self._log_lock:  # downloads update one bar from several threads
                if percent <= self._logged_percent:
                    return shown
                self._logged_percent = percent
            self._log(percent)
        return shown

    def close(self) -> None:
        # A task that was long enough to log and ends short of its total (a tied embedding never read, a
        # download total that was an estimate) still says it ended.
        if not self._closed and not self.disable and 0 < self._logged_percent < 100:
            self._log(min(100, int(100 * self.n / self.total)) if self.total else 100, finished=True)
        self._closed = True
        super().close()

    def _log(self, percent: int, finished: bool = False) -> None:
        done, total = self.n, self.total
        if self.unit == "B":
            amount = f"{tqdm.format_sizeof(done, 'B', 1024)} of {tqdm.format_sizeof(total, 'B', 1024)}"
        else:
            amount = f"{done:g} of {total:g} {self.unit}s"
        fields = {"task": self.desc, "percent": percent, "done": done, "total": total, "unit": self.unit}
        state = "done" if finished else f"{percent}%"
        log.info("%s: %s (%s)", self.desc or "Progress", state, amount, extra={"fields": fields})
