"""The waiting queue: FIFO order, budgets, blocks, min/max batch sizes, cancellation, admission."""

from __future__ import annotations

import pytest

from kettle.router.blocks import BlockAllocator
from kettle.router.queue import CapacityError, Entry, Queue
from tests.unit.fake_client import make_entry

BIG = 10_000


def filled(num_blocks: int = 64, block_size: int = 4, *entries: Entry) -> tuple[Queue, BlockAllocator]:
    allocator = BlockAllocator(num_blocks, block_size)
    queue = Queue(allocator)
    for entry in entries:
        queue.append(entry)
    return queue, allocator


def ids(batch) -> list[int]:
    return list(batch.entries)


def test_fifo_and_proto_fields():
    queue, _ = filled(64, 4, make_entry(7, input_len=3, max_new=5), make_entry(8))
    batch = queue.next_batch(None, None, BIG, BIG)
    assert ids(batch) == [7, 8]
    first = batch.batch.requests[0]
    assert (first.id, list(first.input_ids), first.inputs) == (7, [100, 101, 102], "xxx")
    assert list(first.blocks) == [0, 1] and list(first.slots) == list(range(8))
    assert first.stopping_parameters.max_new_tokens == 5 and list(first.stopping_parameters.stop_sequences) == ["END"]
    assert first.parameters.top_k == 7 and first.parameters.seed == 42 and first.parameters.do_sample
    assert (first.cache_len, first.chunk_len) == (0, 0)
    assert batch.batch.size == 2 and batch.batch.max_tokens == 8 + 8
    assert len(queue) == 0


def test_prefill_budget_stops_the_batch_and_the_rest_waits():
    queue, _ = filled(64, 4, *(make_entry(i, input_len=4) for i in range(3)))
    assert ids(queue.next_batch(None, None, 8, BIG)) == [0, 1]
    assert len(queue) == 1
    assert ids(queue.next_batch(None, None, 8, BIG)) == [2]


def test_token_budget_counts_prompt_and_new_tokens():
    queue, _ = filled(64, 4, *(make_entry(i, input_len=4, max_new=6) for i in range(3)))
    assert ids(queue.next_batch(None, None, BIG, 25)) == [0, 1]
    assert queue.next_batch(None, None, BIG, 9) is None  # 10 tokens needed
    assert ids(queue.next_batch(None, None, BIG, 10)) == [2]


def test_max_size():
    queue, _ = filled(64, 4, *(make_entry(i) for i in range(5)))
    assert queue.next_batch(None, 0, BIG, BIG) is None
    assert ids(queue.next_batch(None, 2, BIG, BIG)) == [0, 1]
    assert ids(queue.next_batch(None, 10, BIG, BIG)) == [2, 3, 4]


def test_entry_without_blocks_waits_in_place_until_blocks_free():
    # 4 blocks of 4 tokens: the first request takes 2, the second needs 3.
    queue, allocator = filled(4, 4, make_entry(0, 4, 4), make_entry(1, 8, 4), make_entry(2, 4, 1))
    first = queue.next_batch(None, None, BIG, BIG)
    assert ids(first) == [0]  # the second does not fit and the small third must not jump ahead of it
    assert queue.next_batch(None, None, BIG, BIG) is None
    assert len(queue) == 2
    allocator.free(first.entries[0].allocation)
    assert ids(queue.next_batch(None, None, BIG, BIG)) == [1]
    assert len(queue) == 1


def test_min_size_not_reached_puts_everything_back():
    queue, allocator = filled(64, 4, make_entry(0), make_entry(1))
    assert queue.next_batch(3, None, BIG, BIG) is None
    assert len(queue) == 2 and allocator.free_blocks == 64
    assert ids(queue.next_batch(2, None, BIG, BIG)) == [0, 1]


def test_cancelled_entries_are_removed():
    entries = [make_entry(i) for i in range(3)]
    queue, allocator = filled(64, 4, *entries)
    entries[0].cancelled = entries[2].cancelled = True
    batch = queue.next_batch(None, None, BIG, BIG)
    assert ids(batch) == [1]
    assert len(queue) == 0 and allocator.free_blocks == 62


def test_batch_ids_are_distinct():
    queue, _ = filled(64, 4, make_entry(0), make_entry(1))
    first = queue.next_batch(None, 1, BIG, BIG)
    second = queue.next_batch(None, 1, BIG, BIG)
    assert first.batch.id != second.batch.id


def test_request_that_can_never_fit_is_rejected_at_admission():
    allocator = BlockAllocator(4, 4)
    queue = Queue(allocator, max_total_tokens=BIG, max_prefill_tokens=12)
    queue.append(make_entry(0, input_len=8, max_new=8))  # exactly the capacity: accepted
    with pytest.raises(CapacityError, match="must be <= 16") as error:
        queue.append(make_entry(1, input_len=8, max_new=9))
    assert error.value.status == 422 and error.value.error_type == "validation"
    with pytest.raises(CapacityError, match="`inputs` tokens must be <= 12"):
        queue.append(make_entry(2, input_len=13, max_new=1))
    assert len(queue) == 1


def test_drain_empties_the_queue():
    queue, _ = filled(64, 4, make_entry(0), make_entry(1))
    assert [e.id for e in queue.drain()] == [0, 1]
    assert len(queue) == 0
