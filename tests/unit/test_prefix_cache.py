"""The prefix-caching allocator: block hashes, hits, reference counts, LRU eviction, and its use by the queue."""

from __future__ import annotations

import asyncio
import random

import pytest

from kettle.router.blocks import Allocator, BlockAllocator
from kettle.router.config import SchedulerConfig
from kettle.router.infer import make_allocator
from kettle.router.prefix_cache import PrefixCachingAllocator, block_hashes
from kettle.router.queue import Queue
from kettle.router.scheduler import Scheduler
from tests.unit.fake_client import FakeClient, make_entry

BS = 4


def prompt(n: int, start: int = 100) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def run_once(allocator: PrefixCachingAllocator, ids: tuple[int, ...], max_new: int = 4):
    """Allocates, 'prefills' (commit) and returns the live allocation."""
    allocation = allocator.allocate(len(ids) + max_new, ids)
    assert allocation is not None
    allocator.commit(allocation)
    return allocation


def test_block_hashes_chain_over_whole_prefixes():
    a = block_hashes((1, 2, 3, 4, 5, 6, 7, 8, 9), BS)
    assert len(a) == 2  # the partial third block has no hash
    b = block_hashes((9, 9, 9, 9, 5, 6, 7, 8), BS)
    assert a[1] != b[1]  # same second block, different first block: different prefix
    assert block_hashes((1, 2, 3, 4, 5, 6, 7, 8), BS) == a
    assert block_hashes((1, 2, 3), BS) == []


def test_a_repeated_prompt_reuses_its_full_blocks():
    allocator = PrefixCachingAllocator(32, BS)
    ids = prompt(10)  # blocks: 4 + 4 full, 2 in a partial block
    first = run_once(allocator, ids)
    assert first.cache_len == 0
    allocator.free(first)
    second = allocator.allocate(14, ids)
    assert second is not None and second.cache_len == 8
    assert second.blocks[:2] == first.blocks[:2]
    assert second.slots[:8] == first.slots[:8]


def test_the_last_prompt_token_is_always_computed():
    allocator = PrefixCachingAllocator(32, BS)
    ids = prompt(8)  # exactly two full blocks
    allocator.free(run_once(allocator, ids))
    again = allocator.allocate(12, ids)
    assert again is not None and again.cache_len == 4  # the block with the last token is recomputed
    longer = allocator.allocate(10, prompt(9))
    assert longer is not None and longer.cache_len == 8  # one more token: both blocks are usable


def test_partial_prefix_and_miss():
    allocator = PrefixCachingAllocator(32, BS)
    allocator.free(run_once(allocator, prompt(12)))
    diverging = (*prompt(4), 7, 7, 7, 7, 7)  # the second block differs
    assert allocator.allocate(12, diverging).cache_len == 4
    assert allocator.allocate(12, prompt(9, start=500)).cache_len == 0


def test_no_hit_before_commit_or_without_reuse():
    allocator = PrefixCachingAllocator(32, BS)
    ids = prompt(9)
    first = allocator.allocate(12, ids)
    assert allocator.allocate(12, ids).cache_len == 0  # not prefilled yet: nothing to share
    allocator.commit(first)
    assert allocator.allocate(12, ids, reuse=False).cache_len == 0
    assert allocator.allocate(12, ids).cache_len == 8


def test_reference_counts_keep_shared_blocks_alive():
    allocator = PrefixCachingAllocator(8, BS)
    ids = prompt(9)
    first = run_once(allocator, ids)  # 4 blocks: 2 shared-able
    second = allocator.allocate(12, ids)  # reuses 2, takes 1 more
    assert second.cache_len == 8
    allocator.free(first)
    # The shared blocks are still referenced by `second`: neither free nor evictable.
    assert allocator.free_blocks == 8 - 3
    hog = allocator.allocate(5 * BS)
    assert hog is not None and not set(hog.blocks) & set(second.blocks)
    assert allocator.allocate(1) is None
    allocator.free(second)
    allocator.free(hog)
    assert allocator.free_blocks == 8


def test_eviction_takes_the_least_recently_used_unreferenced_blocks():
    allocator = PrefixCachingAllocator(6, BS)
    old, new = prompt(9), prompt(9, start=300)
    allocator.free(run_once(allocator, old, max_new=3))  # 3 blocks, 2 cached
    allocator.free(run_once(allocator, new, max_new=3))  # 3 blocks, 2 cached
    assert allocator.cached_blocks == 4 and allocator.free_blocks == 6
    # 3 blocks: the 2 never-cached free ones, then the oldest cached block (the tail of `old`'s chain).
    assert allocator.allocate(3 * BS) is not None
    assert allocator.cached_blocks == 3
    assert allocator.allocate(12, old).cache_len == 4  # its head survived


def test_running_blocks_are_never_evicted():
    allocator = PrefixCachingAllocator(4, BS)
    running = run_once(allocator, prompt(9), max_new=3)  # 3 blocks, 2 cached and referenced
    assert allocator.allocate(2 * BS) is None  # only 1 block left: cached blocks in use are not evictable
    other = allocator.allocate(BS)
    assert other is not None and other.blocks[0] not in running.blocks


def test_all_blocks_return_after_a_run():
    allocator = PrefixCachingAllocator(16, BS)
    live = [run_once(allocator, prompt(9 + i)) for i in range(3)]
    live += [run_once(allocator, prompt(13, start=900))]
    for allocation in live:
        allocator.free(allocation)
    assert allocator.free_blocks == 16
    assert allocator.cached_blocks > 0
    with pytest.raises(ValueError):
        allocator.free(live[0])  # a double free is a bug


def test_equal_prompts_prefilled_together_keep_one_cached_copy():
    allocator = PrefixCachingAllocator(16, BS)
    a, b = allocator.allocate(12, prompt(9)), allocator.allocate(12, prompt(9))
    allocator.commit(a)
    allocator.commit(b)
    assert allocator.cached_blocks == 2
    allocator.free(a)
    allocator.free(b)
    assert allocator.free_blocks == 16 and allocator.cached_blocks == 2


def test_the_queue_passes_the_prompt_and_cache_len_and_counts_only_computed_tokens():
    allocator = PrefixCachingAllocator(64, BS)
    queue = Queue(allocator)
    queue.append(make_entry(1, input_len=20))
    first = queue.next_batch(None, None, 100, 1000)
    allocator.commit(first.entries[1].allocation)
    queue.append(make_entry(2, input_len=20))
    # 20 prompt tokens do not fit a prefill budget of 5, but only 20 - 16 = 4 are computed.
    second = queue.next_batch(None, None, 5, 1000)
    assert second is not None
    assert second.batch.requests[0].cache_len == 16


def test_decoder_input_details_get_no_hit():
    allocator = PrefixCachingAllocator(64, BS)
    queue = Queue(allocator)
    queue.append(make_entry(1, input_len=20))
    allocator.commit(queue.next_batch(None, None, 100, 1000).entries[1].allocation)
    queue.append(make_entry(2, input_len=20, details=True))
    batch = queue.next_batch(None, None, 100, 1000).batch
    assert batch.requests[0].cache_len == 0 and batch.requests[0].prefill_logprobs


def test_the_config_chooses_the_allocator():
    config = SchedulerConfig(max_batch_prefill_tokens=8, max_batch_total_tokens=8, block_size=4, num_blocks=2)
    allocator: Allocator = make_allocator(config)
    assert isinstance(allocator, PrefixCachingAllocator)
    off = SchedulerConfig(
        max_batch_prefill_tokens=8, max_batch_total_tokens=8, block_size=4, num_blocks=2, prefix_caching=False
    )
    assert isinstance(make_allocator(off), BlockAllocator)


def scheduler_with_cache(client: FakeClient) -> tuple[Scheduler, Queue, PrefixCachingAllocator]:
    config = SchedulerConfig(max_batch_prefill_tokens=1000, max_batch_total_tokens=1000, block_size=BS, num_blocks=64)
    allocator = PrefixCachingAllocator(64, BS)
    queue = Queue(allocator, config.max_batch_total_tokens, config.max_batch_prefill_tokens)
    return Scheduler(client, queue, allocator, config), queue, allocator


async def run_until_idle(scheduler: Scheduler) -> None:
    for _ in range(100):
        if not await scheduler.step():
            return
    raise AssertionError("the scheduler never went idle")


def test_the_second_request_with_the_same_prefix_prefills_less():
    async def main():
        client = FakeClient()
        scheduler, queue, allocator = scheduler_with_cache(client)
        for entry_id in (1, 2):
            queue.append(make_entry(entry_id, input_len=20))
            await run_until_idle(scheduler)
        first, second = client.requests[1], client.requests[2]
        assert first.cache_len == 0 and second.cache_len == 16
        assert len(second.input_ids) - second.cache_len == 4  # computed at prefill, instead of 20
        assert second.blocks[:4] == first.blocks[:4]
        assert allocator.free_blocks == 64 and scheduler.running == 0

    asyncio.run(main())


def test_a_failed_prefill_caches_nothing():
    async def main():
        client = FakeClient()
        scheduler, queue, allocator = scheduler_with_cache(client)
        client.fail_next["prefill"] = "boom"
        queue.append(make_entry(1, input_len=20))
        await run_until_idle(scheduler)
        assert allocator.cached_blocks == 0 and allocator.free_blocks == 64
        queue.append(make_entry(2, input_len=20))
        await run_until_idle(scheduler)
        assert client.requests[2].cache_len == 0

    asyncio.run(main())


@pytest.mark.parametrize("seed", range(4))
def test_random_allocate_commit_free_never_frees_or_corrupts_a_referenced_block(seed):
    """Random traffic over a small cache (so eviction is frequent), checked against a model of the blocks:
    a referenced block is never free, evictable or handed out fresh, reference counts equal the live
    allocations holding a block, and a hit block holds exactly the tokens of the prompt that asks for it."""
    rng = random.Random(seed)
    allocator = PrefixCachingAllocator(24, BS)
    heads = [prompt(12, start=100 * k) for k in range(1, 4)]  # a few shared heads, so hits and sharing happen
    live: list[tuple] = []  # (allocation, prompt, committed)
    content: dict[int, tuple[int, ...]] = {}  # block -> the prompt tokens it holds once written
    for _ in range(400):
        action = rng.random()
        if action < 0.45:
            ids = rng.choice(heads)[: rng.randint(1, 12)] + prompt(rng.randint(0, 9), start=rng.choice([7, 5000]))
            allocation = allocator.allocate(len(ids) + rng.randint(1, 6), ids, reuse=rng.random() < 0.9)
            if allocation is not None:
                for i, block in enumerate(allocation.blocks[: allocation.cache_len // BS]):
                    assert content[block] == ids[i * BS : (i + 1) * BS], "a hit returned another prompt's block"
                live.append((allocation, ids, False))
        elif action < 0.7 and live:
            i = rng.randrange(len(live))
            allocation, ids, committed = live[i]
            if not committed:  # its prefill "writes" the prompt blocks from cache_len on
                for j, block in enumerate(allocation.blocks):
                    if j * BS >= allocation.cache_len and (j + 1) * BS <= len(ids):
                        content[block] = ids[j * BS : (j + 1) * BS]
                allocator.commit(allocation)
                live[i] = (allocation, ids, True)
        elif live:
            allocator.free(live.pop(rng.randrange(len(live)))[0])
        _check_invariants(allocator, [a for a, _, _ in live])
    for allocation, _, _ in live:
        allocator.free(allocation)
    assert allocator.free_blocks == 24


def _check_invariants(allocator: PrefixCachingAllocator, live: list) -> None:
    holders: dict[int, int] = {}
    for allocation in live:
        for block in allocation.blocks:
            holders[block] = holders.get(block, 0) + 1
    assert allocator._refs == holders, "reference counts differ from the live allocations"
    assert not set(holders) & (set(allocator._free) | set(allocator._evictable)), "a referenced block was freed"
    assert len(holders) + allocator.free_blocks == allocator.num_blocks
    for allocation in live:  # blocks written by one request (past its hit) are nobody else's
        written = set(allocation.blocks[allocation.cache_len // BS :])
        others = {b for other in live if other is not allocation for b in other.blocks}
        assert not written & others or all(b in allocator._hash_of for b in written & others)
