"""The start-up line of each process's resident memory, a CPU shard's split of it (KV cache and the rest), the
library pages a shard drops once it is ready, and the garbage collector's pause over a start."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

from kettle.process_memory import (
    _library_mappings,
    format_bytes,
    log_resident_memory,
    release_library_pages,
    resident_bytes,
)


def logged(caplog, **kwargs) -> logging.LogRecord:
    with caplog.at_level(logging.INFO, logger="memory-test"):
        log_resident_memory(logging.getLogger("memory-test"), "shard-0", **kwargs)
    (record,) = caplog.records
    return record


def test_a_process_logs_its_resident_memory_in_one_line(caplog):
    record = logged(caplog)
    assert re.fullmatch(r"Resident memory of shard-0: [0-9.]+ (MiB|GiB)", record.getMessage())
    assert record.fields["process"] == "shard-0"
    assert abs(record.fields["resident_memory_bytes"] - resident_bytes()) < 64 * 2**20
    assert "kv_cache_bytes" not in record.fields


def test_a_cpu_shard_splits_its_memory_into_the_kv_cache_and_the_rest(caplog):
    kv = 8 * 2**20
    record = logged(caplog, kv_cache_bytes=kv)
    total = record.fields["resident_memory_bytes"]
    assert record.fields["kv_cache_bytes"] == kv
    assert record.getMessage() == (
        f"Resident memory of shard-0: {format_bytes(total)} (KV cache 8.0 MiB, the rest {format_bytes(total - kv)})"
    )


def mapping(start: int, perms: str, path: str, rss_kb: int, anonymous_kb: int) -> str:
    """One mapping as /proc/PID/smaps writes it (the fields `_library_mappings` reads, and a few it skips)."""
    return (
        f"{start:x}-{start + 0x10000:x} {perms} 00000000 08:01 1234                       {path}\n"
        f"Size:                 64 kB\nRss:            {rss_kb:8d} kB\nPss:            {rss_kb:8d} kB\n"
        f"Anonymous:      {anonymous_kb:8d} kB\nVmFlags: rd mr mw me\n"
    )


def test_only_clean_read_only_mappings_of_libraries_are_dropped():
    smaps = "".join(
        [
            mapping(0x1000000, "r--p", "/lib/libdemo.so", 16, 0),  # headers and constants: dropped
            mapping(0x1010000, "r-xp", "/lib/libdemo.so", 64, 0),  # code: dropped
            mapping(0x1020000, "r--p", "/lib/libdemo.so", 8, 8),  # relocated (RELRO): its own pages stay
            mapping(0x1030000, "rw-p", "/lib/libdemo.so", 4, 4),  # data
            mapping(0x1040000, "r-xp", "/lib/my lib.so", 0, 0),  # nothing resident: nothing to drop
            mapping(0x2000000, "r--p", "/models/model.gguf", 512, 0),  # weights: no code segment, stay
            mapping(0x2010000, "r--s", "/models/model.gguf", 512, 0),
            mapping(0x3000000, "r-xp", "/dev/zero", 4, 0),  # a device, never a library
            mapping(0x4000000, "rw-p", "", 1024, 1024),  # the heap and anonymous memory
            mapping(0x5000000, "r-xp", "[vdso]", 4, 0),
        ]
    )
    assert _library_mappings(smaps) == [(0x1000000, 0x1010000, 16 * 1024), (0x1010000, 0x1020000, 64 * 1024)]


def test_dropping_library_pages_shrinks_the_resident_set_and_the_code_still_runs():
    import torch

    x = torch.arange(64.0).reshape(8, 8) / 64
    expected = torch.softmax(x @ x.T, dim=-1)
    before = resident_bytes()
    dropped = release_library_pages()
    after = resident_bytes()
    # This test process has run torch, numpy and pytest: tens of MiB of their code are resident.
    assert dropped > 8 * 2**20
    assert after < before - 8 * 2**20, (before, after)
    assert torch.equal(torch.softmax(x @ x.T, dim=-1), expected)  # the code faults back in


def test_without_proc_nothing_is_dropped(tmp_path):
    assert release_library_pages(str(tmp_path / "absent")) == 0


ARENAS = """
import ctypes, sys, threading
from kettle.process_memory import use_one_heap
took = use_one_heap() if sys.argv[1] == "one" else None
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
thread = threading.Thread(target=lambda: [libc.malloc(1 << 16) for _ in range(64)])
thread.start()
thread.join()
print(took)
libc.malloc_stats()  # one "Arena N:" paragraph per arena, on stderr
"""


def arenas(mode: str, **env: str) -> tuple[str, int]:
    """What `use_one_heap` answered in a fresh process whose second thread allocates, and glibc's arena count."""
    done = subprocess.run(
        [sys.executable, "-c", ARENAS, mode], capture_output=True, text=True, check=True, env=os.environ | env
    )
    return done.stdout.strip(), done.stderr.count("Arena ")


def test_one_heap_serves_every_thread_unless_the_environment_says_otherwise():
    assert arenas("default") == ("None", 2)  # glibc's default: the thread gets an arena of its own
    assert arenas("one") == ("True", 1)
    assert arenas("one", MALLOC_ARENA_MAX="4") == ("False", 2)  # the user's setting wins


REUSE = """
import ctypes, resource, sys
from kettle.process_memory import reuse_freed_memory
took = reuse_freed_memory() if sys.argv[1] == "reuse" else None
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]
faults = []
for _ in range(3):  # a step's activations: allocated, written, freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(64 << 20)
    ctypes.memset(block, 1, 64 << 20)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(took, faults[-1])
"""


def reuse(mode: str, **env: str) -> tuple[str, int]:
    """What `reuse_freed_memory` answered in a fresh process, and the page faults of its third 64 MiB block."""
    done = subprocess.run(
        [sys.executable, "-c", REUSE, mode], capture_output=True, text=True, check=True, env=os.environ | env
    )
    took, faults = done.stdout.split()
    return took, int(faults)


def test_a_large_block_freed_is_reused_without_faulting_its_pages_again():
    took, faults = reuse("default")
    assert took == "None" and faults >= (64 << 20) // 4096  # glibc's own: a fresh mapping, every page faulted
    took, faults = reuse("reuse")
    assert took == "True" and faults < 100  # the heap's pages, already in


def test_the_environment_and_the_off_switch_keep_glibc_s_own_behaviour():
    assert reuse("reuse", MALLOC_MMAP_MAX_="65536")[0] == "False"
    assert reuse("reuse", GLIBC_TUNABLES="glibc.malloc.trim_threshold=1000000")[0] == "False"
    took, faults = reuse("reuse", KETTLE_TUNING="reuse-freed-memory=off")
    assert took == "False" and faults >= (64 << 20) // 4096


def test_a_start_pauses_the_collector_and_its_objects_leave_later_walks():
    """In a process of its own (the freeze is process-wide): the collector is off inside the block; once ready, what
    the start made is out of the generations a collection walks, and collection is back on; a block left without
    `keep_start_objects` (a start that failed) turns it back on too."""
    code = """
import gc
from kettle.process_memory import collection_paused, keep_start_objects

with collection_paused():
    assert not gc.isenabled()
    made = {"start": [object()]}
    assert any(o is made for o in gc.get_objects())
    keep_start_objects()
    assert gc.isenabled()
    assert not any(o is made for o in gc.get_objects()) and gc.get_freeze_count() > 0
    later = {"request": []}
    assert any(o is later for o in gc.get_objects())
assert gc.isenabled()
with collection_paused():
    pass
assert gc.isenabled()
try:
    with collection_paused():
        raise ValueError
except ValueError:
    assert gc.isenabled()
"""
    subprocess.run([sys.executable, "-c", code], check=True)
