"""Failure semantics of the batching loop, with scripted shards: whatever a step raises, every request it held
gets an answer (or goes back to the queue if no shard saw it), its blocks return to the pool, the block ledger
balances, and requests outside the step are untouched. Also the liveness rule behind /health."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from kettle.router.blocks import BlockAllocator
from kettle.router.config import SchedulerConfig
from kettle.router.infer import Infer
from kettle.router.liveness import Liveness
from kettle.router.prefix_cache import PrefixCachingAllocator
from kettle.router.queue import Entry, Queue, UnplaceableRequest
from kettle.router.scheduler import Scheduler
from kettle.router.types import GenerationError, TokenEvent
from tests.unit.fake_client import FakeClient, make_entry, make_request

NUM_BLOCKS = 64


def make_scheduler(chunked: bool, prefix: bool = True) -> tuple[Scheduler, Queue, BlockAllocator]:
    config = SchedulerConfig(
        block_size=4,
        num_blocks=NUM_BLOCKS,
        max_batch_prefill_tokens=64,
        max_batch_total_tokens=256,
        chunked_prefill=chunked,
        waiting_served_ratio=0.0,
    )
    allocator = PrefixCachingAllocator(NUM_BLOCKS, 4) if prefix else BlockAllocator(NUM_BLOCKS, 4)
    queue = Queue(allocator, config.max_batch_total_tokens, config.max_batch_prefill_tokens, chunked)
    return Scheduler(FakeClient(), queue, allocator, config), queue, allocator


async def run_loop(scheduler: Scheduler, entries: list[Entry], timeout: float = 5.0) -> None:
    """Runs the real loop (`Scheduler.run`, where a step's failure is settled) until every entry is answered."""
    task = asyncio.create_task(scheduler.run())
    scheduler.wake()
    try:
        async with asyncio.timeout(timeout):
            while not all(e.done for e in entries):
                await asyncio.sleep(0.001)
    finally:
        task.cancel()


def outcome(entry: Entry) -> str:
    """'ok', or the class name of the error that ended it."""
    items = []
    while not entry.channel.empty():
        items.append(entry.channel.get_nowait())
    last = items[-1]
    if isinstance(last, TokenEvent) and last.end is not None:
        return "ok"
    return type(last).__name__


def balanced(scheduler: Scheduler, allocator) -> bool:
    return scheduler.ledger.check([]) and scheduler.ledger.violations == 0 and allocator.free_blocks == NUM_BLOCKS


@pytest.mark.parametrize("chunked", [True, False])
def test_a_request_the_shards_cannot_be_sent_fails_alone(chunked):
    """The reproduction: a stop string protobuf cannot encode used to fail the step and leak every block."""

    async def main():
        scheduler, queue, allocator = make_scheduler(chunked)
        entries = [make_entry(i, input_len=6, max_new=5) for i in range(3)]
        request = make_request(6, 5)
        stopping = dataclasses.replace(request.stopping, stop_sequences=("\ud800",))
        poisoned = Entry(99, dataclasses.replace(request, stopping=stopping))
        for entry in [entries[0], poisoned, *entries[1:]]:
            queue.append(entry)
        await run_loop(scheduler, [*entries, poisoned])
        assert [outcome(e) for e in entries] == ["ok"] * 3
        assert outcome(poisoned) == "UnplaceableRequest"
        assert balanced(scheduler, allocator)

    asyncio.run(main())


def test_an_allocator_failure_fails_that_request_and_the_line_moves_on():
    async def main():
        scheduler, queue, allocator = make_scheduler(chunked=True)
        allocate = allocator.allocate

        def failing(n_tokens, prompt_ids=(), reuse=True, namespace="", images=()):
            if len(prompt_ids) == 7:
                raise RuntimeError("allocator bug")
            return allocate(n_tokens, prompt_ids, reuse, namespace, images)

        allocator.allocate = failing
        bad, good = make_entry(1, input_len=7), make_entry(2, input_len=5)
        queue.append(bad)
        queue.append(good)
        await run_loop(scheduler, [bad, good])
        assert (outcome(bad), outcome(good)) == ("UnplaceableRequest", "ok")
        assert balanced(scheduler, allocator)

    asyncio.run(main())


@pytest.mark.parametrize("chunked", [True, False])
def test_a_step_that_fails_outside_a_shard_call_requeues_the_unsent_and_fails_the_sent(chunked, monkeypatch):
    async def main():
        scheduler, queue, allocator = make_scheduler(chunked)
        running = make_entry(1, input_len=5, max_new=8)
        queue.append(running)
        await scheduler.step()  # `running` is in the shards' batch now
        waiting = make_entry(2, input_len=5, max_new=3)
        queue.append(waiting)
        admit = scheduler._admit
        calls = {"n": 0}

        def admit_once_broken(new):  # the step's bookkeeping breaks after `waiting` was taken from the queue
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("scheduler bug")
            admit(new)

        monkeypatch.setattr(scheduler, "_admit", admit_once_broken)
        await run_loop(scheduler, [running, waiting])
        assert outcome(running) == "GenerationError"  # a shard held it: it cannot be replayed
        assert outcome(waiting) == "ok" and waiting.requeued == 1  # no shard saw it: it went back and ran
        assert balanced(scheduler, allocator)

    asyncio.run(main())


def test_a_request_that_breaks_two_steps_is_failed_not_requeued_forever(monkeypatch):
    async def main():
        scheduler, queue, allocator = make_scheduler(chunked=True)
        entry = make_entry(1)
        queue.append(entry)

        def broken(new):
            raise RuntimeError("always broken")

        monkeypatch.setattr(scheduler, "_admit", broken)
        await run_loop(scheduler, [entry])
        assert outcome(entry) == "GenerationError" and entry.requeued == 1
        assert balanced(scheduler, allocator)

    asyncio.run(main())


@pytest.mark.parametrize("method", ["prefill", "decode", "filter"])
def test_a_failed_shard_call_answers_its_requests_and_frees_their_blocks(method):
    async def main():
        scheduler, queue, allocator = make_scheduler(chunked=True)
        long, short = make_entry(1, max_new=12), make_entry(2, max_new=12)
        queue.append(long)
        queue.append(short)
        await scheduler.step()
        await scheduler.step()
        if method == "filter":
            short.cancelled = True  # the next step filters it out of the shards' batch
        scheduler._client.fail_next[method] = "boom"
        later = make_entry(3, max_new=2)
        queue.append(later)
        await run_loop(scheduler, [long, later, *([] if method == "filter" else [short])])
        assert outcome(long) == "GenerationError"
        assert outcome(later) in ("ok", "GenerationError")  # it may have joined the failed step
        assert balanced(scheduler, allocator)
        again = make_entry(4, max_new=3)
        queue.append(again)
        await run_loop(scheduler, [again])
        assert outcome(again) == "ok" and balanced(scheduler, allocator)

    asyncio.run(main())


def test_the_ledger_catches_a_leaked_block():
    scheduler, _, allocator = make_scheduler(chunked=True)
    assert scheduler.ledger.check([])
    leaked = allocator.allocate(8, (1, 2, 3))
    assert not scheduler.ledger.check([]) and scheduler.ledger.violations == 1
    holder = make_entry(5)
    holder.allocation = leaked
    assert scheduler.ledger.check([holder])


def test_liveness_counts_silence_only_while_there_is_work():
    now = [0.0]
    liveness = Liveness(timeout=10, clock=lambda: now[0])
    now[0] = 100
    assert liveness.stall(has_work=False) is None  # idle for long is fine
    liveness.work_arrived()
    now[0] = 105
    assert liveness.stall(has_work=True) is None
    now[0] = 111
    assert "while requests wait" in liveness.stall(has_work=True)
    liveness.step_started()
    now[0] = 130
    liveness.step_ended(busy=True)  # a 19 s step: the bound grows to 4x that
    assert liveness.bound == pytest.approx(76)
    liveness.step_started()
    now[0] = 200
    assert liveness.stall(has_work=True) is None
    now[0] = 210
    assert "inside one step" in liveness.stall(has_work=True)


class StalledClient(FakeClient):
    """Shards whose decode never returns."""

    async def decode(self, batches, max_steps=1):
        await asyncio.Event().wait()


def test_a_stalled_shard_turns_health_unhealthy_within_the_bound():
    async def main():
        config = SchedulerConfig(
            block_size=4, num_blocks=NUM_BLOCKS, max_batch_prefill_tokens=64, max_batch_total_tokens=256
        )
        config = dataclasses.replace(config, stall_timeout=0.3)
        infer = Infer(StalledClient(), config)
        infer.start()
        assert await infer.health()
        stream = infer.generate(make_request(4, 8))
        first = asyncio.create_task(anext(stream))
        await asyncio.sleep(0.1)
        assert await infer.health()  # within the bound
        await asyncio.sleep(0.5)
        assert not await infer.health()
        first.cancel()
        await infer.stop()

    asyncio.run(main())


def test_rejected_requests_carry_a_validation_status():
    error = UnplaceableRequest(ValueError("Value out of range"))
    assert error.status == 422 and "Value out of range" in str(error)
    assert isinstance(GenerationError("x"), Exception)
