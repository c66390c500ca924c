"""The KV block allocator: sizes, slots, exhaustion and returns."""

from __future__ import annotations

import pytest

from kettle.router.blocks import Allocator, BlockAllocator, blocks_for, slots_for


def test_allocation_covers_the_tokens_with_whole_blocks():
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    allocation = allocator.allocate(6)
    assert allocation is not None
    assert allocation.blocks == (0, 1)
    # Slots follow the blocks and stop at the last token, not at the end of the last block.
    assert allocation.slots == (0, 1, 2, 3, 4, 5)
    assert allocation.cache_len == 0
    assert allocator.free_blocks == 6


def test_slots_follow_non_contiguous_blocks():
    assert slots_for((3, 1), 6, 4) == (12, 13, 14, 15, 4, 5)
    assert blocks_for(8, 4) == 2
    assert blocks_for(9, 4) == 3


def test_not_enough_blocks_returns_none_and_takes_nothing():
    allocator = BlockAllocator(num_blocks=3, block_size=4)
    assert allocator.allocate(8) is not None
    assert allocator.allocate(5) is None
    assert allocator.free_blocks == 1
    assert allocator.allocate(4) is not None
    assert allocator.free_blocks == 0


def test_freed_blocks_are_reused():
    allocator = BlockAllocator(num_blocks=2, block_size=4)
    first = allocator.allocate(8)
    assert allocator.allocate(1) is None
    allocator.free(first)
    assert allocator.free_blocks == 2
    again = allocator.allocate(8)
    assert again is not None and set(again.blocks) == {0, 1}


def test_blocks_handed_out_are_distinct():
    allocator = BlockAllocator(num_blocks=10, block_size=2)
    allocations = [allocator.allocate(3) for _ in range(5)]
    blocks = [b for a in allocations for b in a.blocks]
    assert len(blocks) == len(set(blocks)) == 10
    assert all(0 <= b < 10 for b in blocks)


def test_double_free_raises():
    allocator = BlockAllocator(num_blocks=2, block_size=4)
    allocation = allocator.allocate(4)
    allocator.free(allocation)
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free(allocation)


def test_invalid_sizes_raise():
    with pytest.raises(ValueError):
        BlockAllocator(num_blocks=0, block_size=4)
    with pytest.raises(ValueError):
        BlockAllocator(num_blocks=4, block_size=4).allocate(0)


def test_capacity_and_protocol():
    allocator: Allocator = BlockAllocator(num_blocks=5, block_size=16)
    assert allocator.capacity == 80
    assert allocator.allocate(80) is not None
    assert allocator.allocate(1) is None
