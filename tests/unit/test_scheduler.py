"""The scheduler driven step by step against scripted shards: batching rules, events, cancellation, failures."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from kettle.router.blocks import BlockAllocator
from kettle.router.config import SchedulerConfig
from kettle.router.queue import Entry, Queue
from kettle.router.scheduler import Scheduler
from kettle.router.types import FinishReason, GeneratedText, GenerationError, PrefillEvent, TokenEvent
from tests.unit.fake_client import FakeClient, make_entry

BIG = 10_000


def setup(client: FakeClient, num_blocks: int = 64, **limits) -> tuple[Scheduler, Queue, BlockAllocator]:
    """Most tests here pin TGI's v2 rule (chunking off); tests/unit/test_chunked_prefill.py covers chunking."""
    defaults = {"max_batch_prefill_tokens": BIG, "max_batch_total_tokens": BIG, "waiting_served_ratio": 0.0}
    limits = defaults | {"chunked_prefill": False} | limits
    config = SchedulerConfig(block_size=4, num_blocks=num_blocks, **limits)
    allocator = BlockAllocator(num_blocks, 4)
    queue = Queue(allocator, config.max_batch_total_tokens, config.max_batch_prefill_tokens, config.chunked_prefill)
    return Scheduler(client, queue, allocator, config), queue, allocator


def drain(entry: Entry) -> list:
    items = []
    while not entry.channel.empty():
        items.append(entry.channel.get_nowait())
    return items


def token_ids(items: list) -> list[int]:
    return [e.token.id for e in items if isinstance(e, TokenEvent)]


def finished(entry: Entry) -> bool:
    return entry.done and entry.allocation is None


async def run_until_idle(scheduler: Scheduler, limit: int = 200) -> int:
    steps = 0
    while await scheduler.step():
        steps += 1
        assert steps < limit, "the scheduler never went idle"
    return steps


def test_event_stream_of_one_request():
    async def main():
        client = FakeClient()
        scheduler, queue, allocator = setup(client)
        entry = make_entry(1, input_len=3, max_new=4, details=True)
        queue.append(entry)
        await run_until_idle(scheduler)
        prefill, *tokens = drain(entry)
        assert isinstance(prefill, PrefillEvent)
        assert [t.id for t in prefill.tokens] == [100, 101, 102]
        assert prefill.tokens[0].logprob is None and prefill.tokens[1].logprob == -1.0
        assert token_ids(tokens) == [1, 2, 3, 4] and tokens[0].token.text == "t1"
        assert all(t.end is None for t in tokens[:-1])
        assert tokens[-1].end == GeneratedText("t1t2t3t4", 4, FinishReason.LENGTH, None)
        assert tokens[-1].queued_at <= tokens[-1].started_at
        # Three decode steps; once a step time is known the settled batch runs the last two in one call.
        assert client.method_calls("prefill") == [(0, [1])] and client.steps == [1, 2]
        assert allocator.free_blocks == 64 and client.batches == {}

    asyncio.run(main())


def test_new_request_joins_the_running_batch_between_decode_steps():
    async def main():
        client = FakeClient()
        scheduler, queue, _ = setup(client)
        a, b = make_entry(1, max_new=6), make_entry(2, max_new=2)
        queue.append(a)
        await scheduler.step()
        queue.append(b)
        await scheduler.step()
        assert [c[0] for c in client.calls] == ["prefill", "decode", "prefill", "decode"]
        assert client.method_calls("decode") == [([0],), ([0, 1],)]
        assert token_ids(drain(b)) == [1, 2] and finished(b)
        await run_until_idle(scheduler)
        assert token_ids(drain(a)) == [1, 2, 3, 4, 5, 6]

    asyncio.run(main())


def test_small_new_batch_waits_for_the_ratio_or_max_waiting_tokens():
    async def main():
        client = FakeClient()
        scheduler, queue, _ = setup(client, waiting_served_ratio=0.5, max_waiting_tokens=3)
        for i in range(4):
            queue.append(make_entry(i, max_new=10))
        await scheduler.step()
        queue.append(make_entry(10))
        await scheduler.step()  # 1 waiting < 4 running x 0.5: it does not join yet
        assert len(client.method_calls("prefill")) == 1
        await scheduler.step()  # it has waited max_waiting_tokens steps: it joins
        assert client.method_calls("prefill")[1] == (1, [10])
        queue.append(make_entry(11))
        queue.append(make_entry(12))
        queue.append(make_entry(13))
        await scheduler.step()  # 3 waiting >= 5 running x 0.5: they join at once
        assert client.method_calls("prefill")[2] == (2, [11, 12, 13])

    asyncio.run(main())


def test_max_batch_size_bounds_the_running_batch():
    async def main():
        client = FakeClient()
        scheduler, queue, _ = setup(client, max_batch_size=2)
        entries = [make_entry(i, max_new=3) for i in range(3)]
        for entry in entries:
            queue.append(entry)
        sizes = []
        while await scheduler.step():
            sizes.append(scheduler.running)
        assert max(sizes) == 2
        assert client.method_calls("prefill") == [(0, [0, 1]), (1, [2])]
        assert all(token_ids(drain(e)) == [1, 2, 3] for e in entries)

    asyncio.run(main())


def test_total_token_budget_includes_what_the_running_batch_reserves():
    async def main():
        client = FakeClient()
        scheduler, queue, _ = setup(client, max_batch_total_tokens=20, max_batch_prefill_tokens=20)
        short, long, waiting = make_entry(0, 4, 2), make_entry(1, 4, 6), make_entry(2, 4, 4)  # 6 + 10 + 8 tokens
        for entry in (short, long, waiting):
            queue.append(entry)
        await scheduler.step()
        assert client.method_calls("prefill") == [(0, [0, 1])]
        assert finished(short) and not finished(long)
        await scheduler.step()  # 20 - 10 reserved by `long` leaves room for `waiting`
        assert client.method_calls("prefill")[1] == (1, [2])
        await run_until_idle(scheduler)
        assert token_ids(drain(waiting)) == [1, 2, 3, 4]

    asyncio.run(main())


def test_prefill_token_budget_splits_new_batches():
    async def main():
        client = FakeClient()
        scheduler, queue, _ = setup(client, max_batch_prefill_tokens=8)
        for i in range(3):
            queue.append(make_entry(i, input_len=4, max_new=3))
        await run_until_idle(scheduler)
        assert client.method_calls("prefill") == [(0, [0, 1]), (1, [2])]

    asyncio.run(main())


def test_request_without_free_blocks_waits_and_is_served_later():
    async def main():
        client = FakeClient()
        scheduler, queue, allocator = setup(client, num_blocks=4)
        first, second = make_entry(0, 4, 8), make_entry(1, 4, 4)  # 3 blocks, then 2 of the 4
        queue.append(first)
        queue.append(second)
        await scheduler.step()
        assert scheduler.running == 1 and len(queue) == 1 and not drain(second)
        await run_until_idle(scheduler)
        assert token_ids(drain(first)) == list(range(1, 9))
        assert token_ids(drain(second)) == [1, 2, 3, 4]
        assert allocator.free_blocks == 4

    asyncio.run(main())


def test_cancelled_request_is_filtered_out_and_its_blocks_freed_within_one_step():
    async def main():
        client = FakeClient()
        scheduler, queue, allocator = setup(client)
        a, b = make_entry(1, 4, 10), make_entry(2, 4, 10)  # 14 tokens: 4 blocks each
        queue.append(a)
        queue.append(b)
        await scheduler.step()
        drain(a)
        a.cancelled = True
        await scheduler.step()
        assert client.method_calls("filter") == [(0, [2])]
        assert allocator.free_blocks == 60 and scheduler.running == 1 and not drain(a)
        b.cancelled = True
        await scheduler.step()
        assert client.method_calls("clear") == [(0,)]
        assert allocator.free_blocks == 64 and scheduler.running == 0 and client.batches == {}

    asyncio.run(main())


def test_failed_decode_fails_only_that_batch_and_later_requests_succeed():
    async def main():
        client = FakeClient()
        scheduler, queue, allocator = setup(client)
        a = make_entry(1, max_new=5)
        queue.append(a)
        client.fail_next["decode"] = "CUDA out of memory"
        await scheduler.step()
        error = drain(a)[-1]
        assert isinstance(error, GenerationError) and error.status == 424
        assert str(error) == "Request failed during generation: CUDA out of memory"
        assert client.method_calls("clear") == [(0,)] and allocator.free_blocks == 64
        assert not scheduler.last_call_ok
        b = make_entry(2, max_new=3)
        queue.append(b)
        await run_until_idle(scheduler)
        assert token_ids(drain(b)) == [1, 2, 3] and scheduler.last_call_ok

    asyncio.run(main())


def test_failed_prefill_of_a_new_batch_keeps_the_running_batch():
    async def main():
        client = FakeClient()
        scheduler, queue, allocator = setup(client)
        running, new = make_entry(1, max_new=4), make_entry(2, max_new=4)
        queue.append(running)
        await scheduler.step()
        queue.append(new)
        client.fail_next["prefill"] = "bad batch"
        await scheduler.step()
        assert isinstance(drain(new)[-1], GenerationError)
        assert client.method_calls("clear") == [(1,)]
        await run_until_idle(scheduler)
        assert token_ids(drain(running)) == [1, 2, 3, 4] and allocator.free_blocks == 64

    asyncio.run(main())


@pytest.mark.parametrize("chunked", [False, True])
def test_all_blocks_return_to_the_pool_after_a_mixed_run(chunked):
    async def main():
        client = FakeClient()
        limits = {"max_batch_prefill_tokens": 3 if chunked else 16, "max_batch_size": 4, "chunked_prefill": chunked}
        scheduler, queue, allocator = setup(client, num_blocks=16, **limits)
        entries = [make_entry(i, input_len=1 + i % 5, max_new=1 + (7 * i) % 9) for i in range(20)]
        for entry in entries:
            queue.append(entry)
        for _ in range(3):
            await scheduler.step()
        entries[0].cancelled = entries[7].cancelled = True
        await run_until_idle(scheduler)
        assert allocator.free_blocks == 16 and client.batches == {} and len(queue) == 0
        for entry in entries[1:7] + entries[8:]:
            last = drain(entry)[-1]
            assert last.end is not None and last.end.generated_tokens == entry.request.stopping.max_new_tokens

    asyncio.run(main())


@pytest.mark.parametrize("chunked", [False, True])
def test_a_settled_batch_runs_several_steps_per_call_with_the_same_events(chunked):
    """Requests of different lengths: the events of each equal those of one step per call, in fewer calls."""

    async def run(window_ms: float) -> tuple[list[list], FakeClient]:
        client = FakeClient()
        scheduler, queue, allocator = setup(client, chunked_prefill=chunked, decode_window_ms=window_ms)
        entries = [make_entry(i, input_len=3 + i, max_new=4 + 3 * i, details=True) for i in range(3)]
        for entry in entries:
            queue.append(entry)
        await run_until_idle(scheduler)
        assert allocator.free_blocks == 64 and client.batches == {} and all(finished(e) for e in entries)
        # Timestamps aside (the runs differ in time), every event of every request.
        events = [[_untimed(e) for e in drain(x)] for x in entries]
        return events, client

    several, batched = asyncio.run(run(50.0))
    one, single = asyncio.run(run(0.0))
    assert several == one
    assert set(single.steps) == {1} and max(batched.steps) > 1
    assert sum(batched.steps) == sum(single.steps) and len(batched.steps) < len(single.steps)


def test_decode_calls_run_one_step_while_a_request_waits_to_join():
    async def main():
        client = FakeClient()
        scheduler, queue, _ = setup(client, max_batch_size=1, decode_window_ms=50.0)
        first, second = make_entry(1, max_new=12), make_entry(2, max_new=12)
        queue.append(first)
        await scheduler.step()  # the prefill, then one step: now a step time is known
        queue.append(second)  # waits: the batch is full
        await run_until_idle(scheduler)
        assert token_ids(drain(first)) == list(range(1, 13)) and token_ids(drain(second)) == list(range(1, 13))
        # Every call while the second request waited ran one step, so it joined as soon as the first ended;
        # alone and settled, it then ran several per call.
        admitted = next(i for i, c in enumerate(client.calls) if c[0] == "prefill" and c[2] == [2])
        waited = sum(1 for c in client.calls[:admitted] if c[0] == "decode")
        assert client.steps[:waited] == [1] * 11 and max(client.steps[waited:]) > 1

    asyncio.run(main())

    asyncio.run(main())


def _untimed(event):
    return dataclasses.replace(event, queued_at=None, started_at=None) if isinstance(event, TokenEvent) else event
