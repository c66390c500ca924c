"""Resident memory (RSS) of Kettle's processes: read for the start-up log lines and the router's gauges.

psutil (already a dependency: the shard sizes its threads with it) reads it on every platform Kettle runs on;
on Linux that is one small read of /proc/PID/statm, cheap enough for every metrics scrape.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

import psutil


def resident_bytes(pid: int | None = None) -> int | None:
    """The resident set size of process `pid` (default: this one) in bytes; None when it is gone or unreadable."""
    try:
        return psutil.Process(pid).memory_info().rss
    except (psutil.Error, OSError):
        return None


def format_bytes(size: int) -> str:
    """`size` in MiB, or GiB from 1 GiB on, with one decimal."""
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def log_resident_memory(logger: logging.Logger, process: str, kv_cache_bytes: int = 0) -> None:
    """One line saying how much memory `process` (launcher, router, shard-N) holds now that it is ready, and of
    it how much a resident KV cache (`kv_cache_bytes`, a CPU shard's) and the rest; with --json-output the numbers
    and the process are also structured fields."""
    size = resident_bytes()
    if size is None:
        return
    fields = {"process": process, "resident_memory_bytes": size}
    split = ""
    if kv_cache_bytes:
        fields["kv_cache_bytes"] = kv_cache_bytes
        split = f" (KV cache {format_bytes(kv_cache_bytes)}, the rest {format_bytes(max(size - kv_cache_bytes, 0))})"
    logger.info("Resident memory of %s: %s%s", process, format_bytes(size), split, extra={"fields": fields})


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # noqa: B018 (glibc only: musl and macOS have none)
    except (OSError, AttributeError):
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]  # addresses past 2**31 stay whole
    return libc


MADV_POPULATE_WRITE = 23  # <sys/mman.h>, Linux 5.14+


def populate(address: int, length: int) -> bool:
    """Faults [address, address + length) in, writable, without changing a byte (`madvise` with
    MADV_POPULATE_WRITE); False where the system has no such call or refuses it. ctypes releases the GIL for the
    call, so a thread can run it over gigabytes while the others work."""
    libc = _libc()
    return libc is not None and libc.madvise(address, length, MADV_POPULATE_WRITE) == 0


def release_free_memory() -> None:
    """Returns the C heap's free pages to the system (glibc's `malloc_trim`). Loading the model and parsing the
    tokenizer free far more than they keep (JSON trees, conversion temporaries, the warm-up's activations), and
    glibc keeps freed small blocks mapped for reuse, resident: ~20 MB after the bundled model's start. A no-op
    without glibc."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
