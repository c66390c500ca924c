"""The CPU KV cache's memory: zero tensors in one anonymous mapping, usable at once, their pages faulted in by a
background thread when asked (MADV_POPULATE_WRITE), or in the caller where the kernel has no such call."""

from __future__ import annotations

import time

import psutil
import torch

from kettle.tensors import zeroed_memory
from kettle.tensors.kv_cache import KVCache
from kettle.tensors.zeroed_memory import zeroed_tensors

MIB = 2**20


def rss() -> int:
    return psutil.Process().memory_info().rss


def check_tensors(tensors: list[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> None:
    assert all(t.shape == shape and t.dtype == dtype and t.is_contiguous() for t in tensors)
    assert all(t.data_ptr() % zeroed_memory.ALIGN == 0 for t in tensors)
    assert all(not t.any() for t in tensors)
    for i, tensor in enumerate(tensors):  # each its own memory: a write shows in it alone
        tensor.fill_(i + 1)
    assert [int(t.flatten()[0]) for t in tensors] == [i + 1 for i in range(len(tensors))]
    assert all(bool((t == i + 1).all()) for i, t in enumerate(tensors))


def test_the_pages_fault_in_behind_the_caller():
    shape, count = (1000, 3, 1237), 6  # 7,422,000 bytes a tensor: not a multiple of the alignment
    before = rss()
    tensors, residency = zeroed_tensors(count, shape, torch.float16)
    assert not residency.done.is_set() and rss() - before < 0.5 * count * 7_422_000  # nothing faulted in yet
    residency.start()
    residency.start()  # once only
    assert residency.done.wait(60), "the background thread never finished"
    assert rss() - before >= 0.9 * count * 7_422_000  # resident without anything having been written
    check_tensors(tensors, shape, torch.float16)


def test_the_pages_fault_in_chunk_by_chunk(monkeypatch):
    """Each madvise call holds the process's memory-map lock: the faulting goes in pieces of CHUNK bytes, in
    order, covering the mapping once, so other threads' allocations wait for one piece at most."""
    monkeypatch.setattr(zeroed_memory, "CHUNK", 64 * 1024)
    _, residency = zeroed_tensors(5, (100, 1000), torch.float32)  # 5 x 400,000 bytes, probed with the real call
    calls = []
    monkeypatch.setattr(zeroed_memory, "populate", lambda address, length: calls.append((address, length)) or True)
    assert residency.wait(60)
    start, total = residency.flat.data_ptr(), residency.flat.numel()
    assert all(length <= 64 * 1024 for _, length in calls) and len(calls) == -(-total // (64 * 1024))
    assert [address for address, _ in calls] == [start + i * 64 * 1024 for i in range(len(calls))]
    assert sum(length for _, length in calls) == total


def test_without_madv_populate_write_the_caller_faults_them_in(monkeypatch):
    monkeypatch.setattr(zeroed_memory, "populate", lambda address, length: False)
    before = rss()
    tensors, residency = zeroed_tensors(4, (64, 256), torch.float32)  # 64 KiB each
    assert residency.done.is_set()  # no thread: done on return
    assert rss() - before >= 0.9 * 4 * 64 * 1024
    check_tensors(tensors, (64, 256), torch.float32)


def test_the_cpu_kv_cache_is_resident_on_return_unless_asked_to_fault_in_later():
    shape = dict(num_layers=3, num_blocks=400, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    nbytes = 2 * 3 * 6400 * 2 * 64 * 2  # 9.8 MB
    before = rss()
    later = KVCache(**shape, device="cpu", fault_in_later=True)
    assert not later.residency.done.is_set() and rss() - before < 0.5 * nbytes
    check_tensors([*later.k, *later.v], (6400, 2, 64), torch.float16)
    assert later.residency.wait(60)  # starts the faulting when nothing has
    before = rss()
    now = KVCache(**shape, device="cpu")
    assert now.residency.done.is_set() and rss() - before >= 0.9 * nbytes
    check_tensors([*now.k, *now.v], (6400, 2, 64), torch.float16)


def test_the_faulting_steps_aside_while_the_engine_works(monkeypatch):
    """Beside a decode step the faulting takes a core from the step's threads: no piece faults in while the engine
    works, nor until it has been idle for QUIET_S; then the rest goes on."""
    monkeypatch.setattr(zeroed_memory, "CHUNK", 64 * 1024)
    _, residency = zeroed_tensors(5, (100, 1000), torch.float32)
    calls = []
    monkeypatch.setattr(zeroed_memory, "populate", lambda address, length: calls.append(time.monotonic()) or True)
    with residency.working():
        residency.start()
        time.sleep(0.3)
        assert calls == [] and not residency.done.is_set()
    assert residency.wait(60)
    assert calls and min(calls) >= residency._last_work + zeroed_memory.QUIET_S  # the work's end, as it recorded it


def test_stop_ends_the_faulting_after_its_current_piece(monkeypatch):
    """A stopping shard must not wait for gigabytes of pages it will never use: `stop` ends the faulting after the
    piece in progress and sets `done`, so whoever waits on it returns."""
    monkeypatch.setattr(zeroed_memory, "CHUNK", 64 * 1024)
    _, residency = zeroed_tensors(5, (100, 1000), torch.float32)
    calls = []

    def slow_populate(address: int, length: int) -> bool:
        calls.append(address)
        time.sleep(0.05)
        return True

    monkeypatch.setattr(zeroed_memory, "populate", slow_populate)
    residency.start()
    while not calls:
        time.sleep(0.001)
    residency.stop()
    assert residency.wait(5), "stop left the waiters waiting"
    assert 1 <= len(calls) <= 2 < -(-residency.flat.numel() // (64 * 1024))


def test_stop_before_start_leaves_nothing_to_wait_for():
    _, residency = zeroed_tensors(2, (100, 1000), torch.float32)
    residency.stop()
    assert residency.wait(5)
