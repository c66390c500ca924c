"""Memory for a shard's packed weights, faulted in while the shard still imports.

A shard's first ~1.5 s go to importing torch and the model code, on one core. The weights it then packs (about the
GGUF file's size) go into fresh 2 MiB pages (kettle/tensors/huge_pages.py), and a fresh page costs its first touch:
the kernel zeroes it, and a hypervisor that backs guest memory on first touch maps it as well. On the 2-core VM
measured here, whose host takes back the memory its guest frees, that was 1.2-1.8 s a GiB, paid inside the load: a
1.7B Q4_K_M file's packing took 1.5 s in a fresh shard and 0.4 s in one whose pages were in.

So the launcher tells a shard how many bytes its weights will take, when it knows (a GGUF file on this machine,
served as stored: `--weight-bytes`), and the shard `reserve`s that much before it imports anything heavy: one
mapping, advised into huge pages, faulted in on a daemon thread while the imports run. The load's large tensors are
then cut from it (`take`), and `close` hands back the part the load did not use. An estimate that is short only
means the rest faults in as before.

This module imports no torch: it runs before torch is imported.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
import time

from kettle import settings

NICENESS = 10  # the faulting thread's, above the shard's: the imports the start waits for go first on a busy CPU
HUGE_PAGE = 2 * 2**20  # bytes: x86-64's transparent huge page, the unit of the faulting and of the hand-back
ALIGN = 64  # bytes: each tensor starts on a cache line, as PyTorch's own CPU allocations do
log = logging.getLogger(__name__)


class WeightArena:
    """An anonymous mapping of `nbytes` (advised into huge pages) whose pages a daemon thread faults in, front to
    back, and from which `take` cuts consecutive pieces until `close`."""

    def __init__(self, nbytes: int) -> None:
        self.mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self.mapping.madvise(mmap.MADV_HUGEPAGE)
        self.size = nbytes + HUGE_PAGE
        self.used = 0
        self.faulted = 0  # bytes from the start this thread has passed (faulted in, or taken before it got there)
        self._lock = threading.Lock()
        self._closed = False
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._fault_in, name="weight-fault-in", daemon=True)
        self._thread.start()

    def _fault_in(self) -> None:
        # Zeros written over each huge page (ctypes lets go of the GIL meanwhile), not `madvise(MADV_POPULATE_WRITE)`:
        # that holds the process's memory-map lock, which every mapping the imports make (each shared library torch
        # loads) waits for, and beside a busy machine's slow faults the imports took twice as long. A write fault
        # takes only its own mapping's lock (Linux 6.4+). The pages stay zero, as a fresh mapping's are.
        with contextlib.suppress(OSError, AttributeError):  # Linux: a thread's own priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + NICENESS)
        address = _address(self.mapping)
        while True:
            # Never over a piece already taken, under the lock `take` takes: the load writes its pieces as soon as it
            # has them, while this thread may still be behind, and zeros written after the weights wiped them (the
            # pages of a taken piece fault in as its owner writes them).
            with self._lock:
                start = max(self.faulted, -(-self.used // HUGE_PAGE) * HUGE_PAGE)
                if self._closed or start >= self.size:
                    return
                ctypes.memset(address + start, 0, min(HUGE_PAGE, self.size - start))
                self.faulted = start + HUGE_PAGE

    def take(self, nbytes: int) -> tuple[mmap.mmap, int] | None:
        """The mapping and the offset of `nbytes` of its zero bytes, or None once closed or too full."""
        with self._lock:
            start = -(-self.used // ALIGN) * ALIGN
            if self._closed or start + nbytes > self.size:
                return None
            self.used = start + nbytes
            return self.mapping, start

    def close(self) -> None:
        """Ends the cutting and the faulting, and hands the pages past the last piece back to the system."""
        with self._lock:
            self._closed = True
        self._thread.join()
        keep = -(-self.used // HUGE_PAGE) * HUGE_PAGE
        if keep < self.size and hasattr(mmap, "MADV_DONTNEED"):
            self.mapping.madvise(mmap.MADV_DONTNEED, keep, self.size - keep)
        log.info(
            "Weights: %d MiB taken of %d MiB reserved, %d MiB faulted in beside the imports (%.1f s after the start)",
            self.used >> 20,
            self.size >> 20,
            min(self.faulted, self.size) >> 20,
            time.monotonic() - self._started,
        )


def _address(mapping: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mapping))


_current: WeightArena | None = None


def reserve(nbytes: int) -> None:
    """Starts faulting in `nbytes` for this process's weights (nothing below one huge page, nor with
    `huge-pages=off`, whose weights PyTorch allocates)."""
    global _current
    if nbytes >= HUGE_PAGE and _current is None and settings.current().huge_pages:
        _current = WeightArena(nbytes)


def take(nbytes: int) -> tuple[mmap.mmap, int] | None:
    """A piece of the reserved memory (`WeightArena.take`), or None without one."""
    return None if _current is None else _current.take(nbytes)


def close() -> None:
    """The weights are loaded: what the reservation did not give them goes back."""
    global _current
    if _current is not None:
        _current.close()
        _current = None
