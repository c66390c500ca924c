"""Chunked prefill in the scheduler, step by step against the scripted shards (vLLM-v1-style assertions).

Each forward of `FakeClient.forwards` is ({request id: prompt tokens computed}, [ids that decoded]); the fake
computes prompts exactly as the shard does (from `cache_len`, `chunk_len` tokens per forward) and yields a
request's first token only in the forward that completes its prompt.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from kettle.router.blocks import BlockAllocator
from kettle.router.chunk_budget import ChunkBudget
from kettle.router.config import SchedulerConfig
from kettle.router.prefix_cache import PrefixCachingAllocator
from kettle.router.queue import CapacityError, Entry, Queue
from kettle.router.scheduler import Scheduler
from kettle.router.types import GenerationError, PrefillEvent, TokenEvent
from tests.unit.fake_client import FakeClient, make_entry

BS = 4


def setup(client: FakeClient, budget: int, num_blocks: int = 64, prefix_caching: bool = False, **limits):
    config = SchedulerConfig(
        max_batch_prefill_tokens=budget, max_batch_total_tokens=num_blocks * BS, block_size=BS,
        num_blocks=num_blocks, prefix_caching=prefix_caching, adaptive_chunks=False, **limits,
    )  # fmt: skip
    allocator = PrefixCachingAllocator(num_blocks, BS) if prefix_caching else BlockAllocator(num_blocks, BS)
    queue = Queue(allocator, config.max_batch_total_tokens, config.max_batch_prefill_tokens, chunked=True)
    return Scheduler(client, queue, allocator, config), queue, allocator


def events(entry: Entry) -> list:
    items = []
    while not entry.channel.empty():
        items.append(entry.channel.get_nowait())
    return items


def token_ids(items: list) -> list[int]:
    return [e.token.id for e in items if isinstance(e, TokenEvent)]


async def run_until_idle(scheduler: Scheduler, limit: int = 500) -> None:
    for _ in range(limit):
        if not await scheduler.step():
            return
    raise AssertionError("the scheduler never went idle")


def test_long_prompt_is_split_and_the_running_decodes_ride_along():
    async def main():
        client = FakeClient()
        scheduler, queue, _ = setup(client, budget=4)
        running, long = make_entry(1, input_len=3, max_new=8), make_entry(2, input_len=10, max_new=2)
        queue.append(running)
        await scheduler.step()
        queue.append(long)
        for _ in range(3):
            await scheduler.step()
            if long.in_prefill:
                assert not events(long), "a partially prefilled request was sampled"
        assert client.forwards == [({1: 3}, []), ({2: 4}, [1]), ({2: 4}, [1]), ({2: 2}, [1])]
        # The first chunk joins in a Prefill with the running batch; later chunks travel as chunk_lens of a Decode.
        assert [c[0] for c in client.calls] == ["prefill", "prefill", "decode", "decode"]
        assert token_ids(events(long)) == [1] and token_ids(events(running)) == [1, 2, 3, 4]
        await run_until_idle(scheduler)
        assert token_ids(events(long)) == [2]

    asyncio.run(main())


def test_new_requests_take_what_the_running_prefill_leaves_of_the_budget():
    async def main():
        client = FakeClient()
        scheduler, queue, _ = setup(client, budget=8)
        for entry in (make_entry(1, input_len=10, max_new=3), make_entry(2, 4, 3), make_entry(3, 6, 3)):
            queue.append(entry)
        await run_until_idle(scheduler)
        prompts = [f[0] for f in client.forwards]
        # Step 2: entry 1 completes (2), entry 2 fits (4), entry 3 gets the last 2 tokens as a first chunk.
        assert prompts[:3] == [{1: 8}, {1: 2, 2: 4, 3: 2}, {3: 4}]
        assert all(sum(p.values()) <= 8 for p in prompts)
        assert client.forwards[2][1] == [1, 2], "running decodes ride along with the last chunk"

    asyncio.run(main())


def test_a_prompt_longer_than_the_budget_is_queued_only_with_chunking():
    allocator = BlockAllocator(64, BS)
    Queue(allocator, 256, 8, chunked=True).append(make_entry(1, input_len=20))
    with pytest.raises(CapacityError, match="`inputs` tokens must be <= 8"):
        Queue(allocator, 256, 8, chunked=False).append(make_entry(2, input_len=20))


def test_prompt_logprobs_arrive_once_with_the_first_token():
    async def main():
        client = FakeClient()
        scheduler, queue, _ = setup(client, budget=3)
        entry = make_entry(1, input_len=7, max_new=2, details=True)
        queue.append(entry)
        await run_until_idle(scheduler)
        prefill, *tokens = events(entry)
        assert isinstance(prefill, PrefillEvent) and len(prefill.tokens) == 7
        assert token_ids(tokens) == [1, 2] and len(client.forwards) == 4

    asyncio.run(main())


def test_prompt_blocks_are_shared_only_after_the_last_chunk():
    async def main():
        client = FakeClient()
        scheduler, queue, allocator = setup(client, budget=4, prefix_caching=True)
        queue.append(make_entry(1, input_len=12, max_new=6))
        await scheduler.step()
        await scheduler.step()
        assert allocator.cached_blocks == 0, "blocks were shared before the prompt was complete"
        queue.append(make_entry(2, input_len=17, max_new=2))  # starts with entry 1's 12 tokens (3 blocks)
        await scheduler.step()  # entry 1's last chunk: no room left for entry 2 this step
        assert allocator.cached_blocks == 3
        await scheduler.step()
        assert client.requests[2].cache_len == 12
        await run_until_idle(scheduler)
        # The hit skips 12 prompt tokens; the other 5 are computed in chunks of the budget.
        assert [f[0] for f in client.forwards][:6] == [{1: 4}, {1: 4}, {1: 4}, {2: 4}, {2: 1}, {}]

    asyncio.run(main())


def test_cancelled_partial_prefill_is_dropped_and_its_blocks_freed():
    async def main():
        client = FakeClient()
        scheduler, queue, allocator = setup(client, budget=4)
        running, long = make_entry(1, input_len=2, max_new=10), make_entry(2, input_len=20, max_new=3)
        queue.append(running)
        queue.append(long)
        await scheduler.step()
        long.cancelled = True
        await scheduler.step()
        assert client.method_calls("filter")[-1] == (0, [1]) and scheduler.running == 1
        await run_until_idle(scheduler)
        assert allocator.free_blocks == 64 and token_ids(events(running)) == list(range(1, 11))

    asyncio.run(main())


def test_a_failed_mixed_forward_fails_every_request_in_it_and_commits_nothing():
    async def main():
        client = FakeClient()
        scheduler, queue, allocator = setup(client, budget=4, prefix_caching=True)
        running, long = make_entry(1, input_len=2, max_new=10), make_entry(2, input_len=9, max_new=3)
        queue.append(running)
        await scheduler.step()
        queue.append(long)
        await scheduler.step()
        client.fail_next["decode"] = "boom"
        await scheduler.step()
        assert isinstance(events(long)[-1], GenerationError) and isinstance(events(running)[-1], GenerationError)
        assert allocator.free_blocks == 64 and allocator.cached_blocks == 0 and scheduler.running == 0

    asyncio.run(main())


@pytest.mark.parametrize("seed", range(3))
def test_random_arrivals_keep_the_budget_and_every_decode_in_every_forward(seed):
    async def main():
        rng = random.Random(seed)
        client = FakeClient()
        budget = rng.choice([3, 5, 8])
        scheduler, queue, allocator = setup(client, budget=budget, num_blocks=48, prefix_caching=bool(seed % 2))
        entries = [make_entry(i, input_len=rng.randint(1, 20), max_new=rng.randint(1, 6)) for i in range(25)]
        pending = list(entries)
        while pending or await scheduler.step():
            for _ in range(rng.randint(0, 2)):
                if pending:
                    queue.append(pending.pop(0))
            decoding = {e.id for e in scheduler._running.values() if not e.in_prefill}
            before = len(client.forwards)
            await scheduler.step()
            if len(client.forwards) > before:
                prompts, decoded = client.forwards[-1]
                assert sum(prompts.values()) <= budget and set(decoded) >= decoding - {e.id for e in entries if e.done}
            for entry in scheduler._running.values():  # the router's prefill progress is the shard's
                assert entry.prefilled_len == client.prefilled[entry.id]
        for entry in entries:
            assert token_ids(events(entry)) == list(range(1, entry.request.stopping.max_new_tokens + 1))
        assert allocator.free_blocks == 48 and client.batches == {}

    asyncio.run(main())


def test_chunk_budget_keeps_a_step_with_decodes_near_a_decode_step():
    budget = ChunkBudget(max_tokens=512, ratio=2.0, min_tokens=16)
    assert budget.tokens(decoding=False) == 512 and budget.tokens(decoding=True) == 16  # not measured yet
    budget.observe(0.050, prompt_tokens=0)  # a decode step: 50 ms
    budget.observe(0.050 + 64 * 0.002, prompt_tokens=64)  # 2 ms per prompt token
    assert budget.tokens(decoding=True) == 25  # (2 - 1) x 50 ms / 2 ms
    assert budget.tokens(decoding=False) == 512
    for _ in range(30):
        budget.observe(0.050 + 64 * 0.00005, prompt_tokens=64)  # cheaper tokens: the budget grows, capped
    assert budget.tokens(decoding=True) == 512
    assert ChunkBudget(512, adaptive=False).tokens(decoding=True) == 512
    with pytest.raises(ValueError):
        ChunkBudget(512, ratio=1.0)


def test_a_prefill_budget_below_max_input_tokens_needs_chunking():
    from kettle.router.config import RouterConfig
    from kettle.router.server import StartupError, choose_limits

    base = {"master_shard_uds_path": "/tmp/x", "tokenizer_name": "t", "model_id": "m", "max_input_tokens": 200}
    assert choose_limits(RouterConfig(**base, max_batch_prefill_tokens=16), 256).max_batch_prefill_tokens == 16
    with pytest.raises(StartupError, match="must be >= `max_input_tokens`"):
        choose_limits(RouterConfig(**base, max_batch_prefill_tokens=16, disable_chunked_prefill=True), 256)
