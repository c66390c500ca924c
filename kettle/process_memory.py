"""Resident memory (RSS) of Kettle's processes: read for the start-up log lines and the router's gauges, and kept
down: freed heap handed back (`release_free_memory`), one heap for every thread (`use_one_heap`), and the library
pages start-up ran dropped once a shard is warm (`release_library_pages`). A shard also keeps the memory of its
steps' large blocks in that heap from one step to the next (`reuse_freed_memory`), handed back once it is idle. The
objects a start makes are kept out of the cyclic garbage collector's walks (`collection_paused`,
`keep_start_objects`).

psutil (already a dependency: the shard sizes its threads with it) reads it on every platform Kettle runs on;
on Linux that is one small read of /proc/PID/statm, cheap enough for every metrics scrape.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import psutil

from kettle import settings


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


MADV_DONTNEED = 4  # <sys/mman.h>
M_ARENA_MAX = -8  # <malloc.h>
M_TRIM_THRESHOLD = -1  # <malloc.h>
M_MMAP_MAX = -4  # <malloc.h>
# Free bytes at the heap's top that `free` leaves there (glibc trims past it; an `int`): about what a long prompt's
# chunk allocates in one step (an 8B model's gate and up projections over 4,096 tokens: ~0.9 GiB), so that a step
# rarely hands back what the next one faults in again. The idle shard's `release_free_memory` trims it all.
KEEP_AT_TOP = 2**30
# The glibc variables that set the same two things (`mallopt(3)`, `tunables(7)`): the user's word wins.
MALLOC_ENVIRONMENT = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")
MALLOC_TUNABLES = ("glibc.malloc.mmap_max", "glibc.malloc.trim_threshold")
MADV_POPULATE_WRITE = 23  # <sys/mman.h>, Linux 5.14+


def populate(address: int, length: int) -> bool:
    """Faults [address, address + length) in, writable, without changing a byte (`madvise` with
    MADV_POPULATE_WRITE); False where the system has no such call or refuses it. ctypes releases the GIL for the
    call, so a thread can run it over gigabytes while the others work."""
    libc = _libc()
    return libc is not None and libc.madvise(address, length, MADV_POPULATE_WRITE) == 0


def reuse_freed_memory() -> bool:
    """Has glibc keep the memory of freed large blocks in the heap for the next ones (`M_MMAP_MAX` 0, `M_TRIM_THRESHOLD`
    `KEEP_AT_TOP`), unless the environment sets either or `KETTLE_TUNING=reuse-freed-memory=off`; call it before the
    model runs. True where it took effect.

    glibc serves each block from 32 MiB (from 128 KiB until its threshold adapts) with a mapping of its own and unmaps
    it when freed, and PyTorch's CPU tensors come straight from malloc: each prefill step's activations (a 512-token
    chunk of a 1.7B model: 32 MiB for the gate and up projections alone) came in fresh 4 KiB pages, a fault and a
    zeroing each, ~9% of a profile of the prompt. A 512-token prefill of a 1.7B Q4_K_M file ran 123 tok/s, and 138
    with the memory kept (2,048 tokens: 97-100 against 104-109). The peak is the same; what the steps freed stays
    resident until the shard is idle (kettle/shard/service.py), when `release_free_memory` hands it back with the rest
    of the heap's free pages."""
    libc = _libc()
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if (
        libc is None
        or not settings.current().reuse_freed_memory
        or any(name in os.environ for name in MALLOC_ENVIRONMENT)
        or any(name in tunables for name in MALLOC_TUNABLES)
    ):
        return False
    return libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, KEEP_AT_TOP) == 1


def release_free_memory() -> None:
    """Returns the C heap's free pages to the system (glibc's `malloc_trim`). Loading the model and parsing the
    tokenizer free far more than they keep (JSON trees, conversion temporaries, the warm-up's activations), and
    glibc keeps freed small blocks mapped for reuse, resident: ~20 MB after the bundled model's start. A no-op
    without glibc."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a start, until `keep_start_objects` (the process is ready) or the
    block's end. Starting a shard or the router makes hundreds of thousands of objects that live as long as the
    process (the modules of torch, FastAPI and the model code, the loaded model), and each full collection walks all
    of them: 0.15-0.2 s of a shard's imports on a 2-core machine. Nothing a start makes is cyclic garbage worth that."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def keep_start_objects() -> None:
    """Once the process is ready: what the start made goes into the collector's permanent generation, which no
    collection walks again (as vLLM does after its start), and collection resumes for what serving makes. A full
    collection between steps then walks the objects of the requests in flight, not the whole interpreter."""
    gc.freeze()
    gc.enable()


def use_one_heap() -> bool:
    """Has every thread of this process allocate from glibc's main heap (`M_ARENA_MAX` 1), unless the environment's
    MALLOC_ARENA_MAX says otherwise; call it before any other thread starts. True where it took effect.

    glibc gives each thread that allocates an arena of its own. `malloc_trim` hands back the free pages inside every
    arena, but the free space at the top of a thread's arena goes back only past a threshold that glibc raises with
    each large block freed (up to 64 MiB): the shard's engine thread, which runs the model, ended each burst of
    requests with 25-50 MiB resident there and free. The main heap's top is trimmed by `malloc_trim` too. The
    shard's other threads (the event loop, gRPC's, OpenMP's) allocate little, so one lock costs nothing measurable
    (docs/deployment.md)."""
    libc = _libc()
    if libc is None or "MALLOC_ARENA_MAX" in os.environ:
        return False
    return libc.mallopt(M_ARENA_MAX, 1) == 1


def release_library_pages(smaps: str = "/proc/self/smaps") -> int:
    """Drops the pages of loaded libraries' code and constants from this process's resident set; returns the bytes
    dropped (0 where there is no /proc). Start-up runs code all over the libraries once (torch's static
    initializers alone touch ~60 MiB of libtorch_cpu's text) that serving never runs again, and those pages count
    in the resident set until the kernel reclaims them under pressure. They stay in the page cache: a page used
    again faults back from memory, not from the disk (~20 MiB of them do as the bundled model serves).

    Only what MADV_DONTNEED cannot change is dropped: private, read-only mappings of a file that has a code
    segment mapped (a library or the interpreter, never a model's weights), holding no page of their own
    (smaps' `Anonymous: 0`: relocated data and anything written stay). The mappings are read, then advised: safe
    because nothing unmaps a library in between (Python never unloads an extension module or a ctypes library)."""
    libc = _libc()
    if libc is None:
        return 0
    try:
        mappings = _library_mappings(Path(smaps).read_text())
    except OSError:
        return 0
    dropped = 0
    for start, end, resident in mappings:
        if libc.madvise(start, end - start, MADV_DONTNEED) == 0:
            dropped += resident
    return dropped


def _library_mappings(smaps: str) -> list[tuple[int, int, int]]:
    """(start, end, resident bytes) of each mapping `release_library_pages` may drop, from smaps' text."""
    entries: list[dict] = []
    for line in smaps.splitlines():
        head, _, rest = line.partition(" ")
        if not head.endswith(":"):  # "start-end perms offset dev inode [path]" opens each mapping
            fields = rest.split(maxsplit=4)
            start, end = (int(part, 16) for part in head.split("-"))
            path = fields[4] if len(fields) > 4 else ""
            entries.append({"start": start, "end": end, "perms": fields[0], "path": path})
        elif entries and head in ("Rss:", "Anonymous:"):
            entries[-1][head] = int(rest.split()[0]) * 1024
    libraries = {entry["path"] for entry in entries if entry["perms"] == "r-xp" and entry["path"].startswith("/")}
    return [
        (entry["start"], entry["end"], entry.get("Rss:", 0))
        for entry in entries
        if entry["path"] in libraries
        and not entry["path"].startswith("/dev/")
        and entry["perms"] in ("r-xp", "r--p")
        and entry.get("Anonymous:", 1) == 0
        and entry.get("Rss:", 0) > 0
    ]


def exit_without_teardown() -> NoReturn:
    """Ends a shard or router that stopped cleanly without the interpreter's teardown: finalizing torch, OpenMP and
    gRPC took 0.45 s of a shard's stop and 0.15 s of the router's (bundled model), time the drain's deadline plus one
    second has not got to spare. Call it only when everything the process owes the world is done: the answers
    sent, the socket removed, spans flushed; the logs and standard streams are flushed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
