"""Zero-filled CPU tensors whose pages fault in later, on a background thread: the CPU KV cache's memory.

The bundled model's KV cache is 2.3 GiB. Zeroing it with `torch.zeros` faults in every page before the warm-up
can go on: 0.5-2.5 s of every start on the 2-core VM measured here (the hypervisor backs each page on its first
touch, whichever way it is touched, and how long that takes depends on what the host did last). An anonymous
mapping is zero-filled by the kernel already, so the tensors are usable at once. `Residency.start` then faults the
pages in on a daemon thread with `madvise(MADV_POPULATE_WRITE)`, which writes nothing (so it may run while the
engine writes K/V into the same pages). The shard starts it after its warm-up prefill: run beside that prefill it
held the prefill's two OpenMP threads back at every barrier (1.5-2.5 s instead of 0.55), more than it saved.
`KVCache` waits for it unless asked not to (`fault_in_later`), so benchmarks and tests see a resident cache.
Where the kernel lacks MADV_POPULATE_WRITE (before Linux 5.14) the pages are zeroed in the caller at once, as
`torch.zeros` would.

The faulting goes `CHUNK` bytes per call. `madvise` holds the process's memory-map lock while it works, and
everything that maps or unmaps memory (a large malloc, a PyTorch tensor, a Python arena, a thread's stack) waits
for that lock: one call over the whole 2.3 GiB held every such allocation back for 3.6 s here, the router's
first health read of the shard among them (the server answered 4.5 s after it said it was serving). In 32 MiB
calls the longest wait measured 8 ms.

The faulting steps aside while the engine works (`Residency.working`): beside a decode step it took one of the
two cores from the step's OpenMP team, whose every barrier then waited for it, and the first requests after a
start decoded at a quarter of their speed for the 0.7-2.4 s the faulting took (a benchmark that started at once
measured 53 tok/s for a 200 tok/s stream). A page the engine writes first faults in then, as without this thread.
"""

from __future__ import annotations

import logging
import math
import mmap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kettle.process_memory import populate
from kettle.tensors import huge_pages

ALIGN = 64  # bytes: each tensor starts on a cache line, as PyTorch's own CPU allocations do
CHUNK = 32 * 2**20  # bytes faulted in per madvise call (see above)
# The engine idle this long before the next piece faults in: longer than the router's turn between two decode calls
# of a running batch (~1-2 ms), so a stream never shares its cores with the faulting.
QUIET_S = 0.05
log = logging.getLogger(__name__)


class Residency:
    """Whether a mapping's pages are all in: `start` faults them in on a daemon thread (once), `done` is set after.
    Without a mapping (`flat` None) they are in already."""

    def __init__(self, flat: torch.Tensor | None) -> None:
        self.flat = flat
        self.done = threading.Event()
        self._started = threading.Lock()
        self._work = threading.Condition()
        self._working, self._last_work = 0, 0.0
        self._stopped = False
        if flat is None:
            self.done.set()

    @contextmanager
    def working(self) -> Iterator[None]:
        """Marks the engine's work: no page faults in while it runs, nor until it has been idle for QUIET_S."""
        with self._work:
            self._working += 1
        try:
            yield
        finally:
            with self._work:
                self._working -= 1
                self._last_work = time.monotonic()

    def _wait_idle(self) -> None:
        with self._work:
            while not self._stopped and (self._working or (wait := self._last_work + QUIET_S - time.monotonic()) > 0):
                self._work.wait(QUIET_S if self._working else wait)

    def start(self) -> None:
        """Begins faulting the pages in, if nothing has yet; returns at once."""
        if self.flat is None or not self._started.acquire(blocking=False):
            return
        if self._stopped:  # stopped before it started: nothing will fault them in now
            self.done.set()
            return
        threading.Thread(target=self._fault_in, name="kv-cache-fault-in", daemon=True).start()

    def stop(self) -> None:
        """Ends the faulting after its current piece (the process is stopping): the pages left fault in on first
        use, and `done` is set, so nothing waiting on it holds the exit back (a 2 GiB cache takes seconds)."""
        with self._work:
            self._stopped = True
            self._work.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Starts the faulting if needed and waits for it; False if `timeout` passed first."""
        self.start()
        return self.done.wait(timeout)

    def _fault_in(self) -> None:
        # A failure leaves the remaining pages to fault in on first use, which changes nothing but when the memory
        # is taken.
        started = time.monotonic()
        address, size = self.flat.data_ptr(), self.flat.numel()
        for offset in range(0, size, CHUNK):
            self._wait_idle()
            if self._stopped:
                break
            if not populate(address + offset, min(CHUNK, size - offset)):
                log.debug("MADV_POPULATE_WRITE failed: the KV cache's pages fault in on first use")
                break
        log.debug("KV cache memory resident after %.1f s", time.monotonic() - started)
        self.done.set()


def zeroed_tensors(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[list[torch.Tensor], Residency]:
    """`count` zero tensors of `shape` and `dtype` in one anonymous mapping, and its `Residency`."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    stride = -(-nbytes // ALIGN) * ALIGN
    flat = huge_pages.anonymous(max(stride * count, 1))  # a decode step reads its sequences' blocks whole
    tensors = [flat[i * stride : i * stride + nbytes].view(dtype).view(shape) for i in range(count)]
    if populate(flat.data_ptr(), min(flat.numel(), mmap.PAGESIZE)):  # asked once here: a refusal means no such call
        return tensors, Residency(flat)
    flat.zero_()  # faults every page in now
    return tensors, Residency(None)
