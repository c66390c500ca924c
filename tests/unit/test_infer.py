"""`Infer` with its scheduler task running against scripted shards: streams, disconnects, errors, health."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from kettle.router.blocks import BlockAllocator
from kettle.router.config import SchedulerConfig
from kettle.router.infer import Infer
from kettle.router.queue import CapacityError
from kettle.router.types import GenerationError, IncompleteGeneration, ShuttingDown, TokenEvent
from tests.unit.fake_client import FakeClient, make_request

CONFIG = SchedulerConfig(max_batch_prefill_tokens=64, max_batch_total_tokens=256, block_size=4, num_blocks=64)


def make_infer(client: FakeClient) -> tuple[Infer, BlockAllocator]:
    allocator = BlockAllocator(CONFIG.num_blocks, CONFIG.block_size)
    return Infer(client, CONFIG, allocator), allocator


async def collect(infer: Infer, max_new: int) -> list[int]:
    return [e.token.id async for e in infer.generate(make_request(max_new=max_new)) if isinstance(e, TokenEvent)]


async def wait_for(condition, steps: int = 1000) -> None:
    for _ in range(steps):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


def test_concurrent_requests_stream_their_tokens_and_free_every_block():
    async def main():
        client = FakeClient()
        infer, allocator = make_infer(client)
        infer.start()
        results = await asyncio.gather(*(collect(infer, n) for n in (3, 7, 1, 5)))
        await infer.stop()
        assert results == [[1, 2, 3], list(range(1, 8)), [1], [1, 2, 3, 4, 5]]
        assert allocator.free_blocks == 64 and client.batches == {}

    asyncio.run(main())


def test_closing_the_stream_cancels_the_request_and_frees_its_blocks():
    async def main():
        client = FakeClient()
        infer, allocator = make_infer(client)
        infer.start()
        other = asyncio.create_task(collect(infer, 100))
        await wait_for(lambda: client.method_calls("decode"))  # `other` runs; the stream joins its batch
        stream = infer.generate(make_request(max_new=100))
        first = await anext(stream)
        assert first.token.id == 1
        await stream.aclose()  # the HTTP client went away
        await wait_for(lambda: client.method_calls("filter"))
        assert len(await other) == 100
        await infer.stop()
        assert allocator.free_blocks == 64

    asyncio.run(main())


def test_a_failed_batch_raises_generation_error_and_the_next_request_succeeds():
    async def main():
        client = FakeClient()
        infer, _ = make_infer(client)
        infer.start()
        client.fail_next["decode"] = "device lost"
        with pytest.raises(GenerationError, match="device lost"):
            await collect(infer, 5)
        assert await collect(infer, 2) == [1, 2]
        await infer.stop()

    asyncio.run(main())


def test_request_the_shards_drop_without_finishing_is_incomplete():
    class DroppingClient(FakeClient):
        async def decode(self, batches, max_steps=1):
            generations, _, timings = await super().decode(batches, max_steps)
            return generations, None, timings

    async def main():
        infer, allocator = make_infer(DroppingClient())
        infer.start()
        with pytest.raises(IncompleteGeneration):
            await collect(infer, 5)
        await infer.stop()
        assert allocator.free_blocks == 64

    asyncio.run(main())


def test_request_larger_than_the_kv_budget_is_rejected():
    async def main():
        infer, _ = make_infer(FakeClient())
        with pytest.raises(CapacityError, match="must be <= 256"):
            await collect(infer, 300)
        assert infer.queue_size == 0

    asyncio.run(main())


def test_stop_ends_queued_requests():
    async def main():
        infer, _ = make_infer(FakeClient())  # never started: the request stays queued
        task = asyncio.create_task(collect(infer, 3))
        await wait_for(lambda: infer.queue_size == 1)
        await infer.stop()
        with pytest.raises(IncompleteGeneration):
            await task

    asyncio.run(main())


class StuckClient(FakeClient):
    """Decodes once, then hangs in its next decode call, as a long step would."""

    async def decode(self, batches, max_steps=1):
        if self.method_calls("decode"):
            await asyncio.Event().wait()
        return await super().decode(batches, max_steps)


def test_stop_with_an_error_ends_running_and_queued_requests_with_it():
    """The drain's deadline: every request still running or waiting gets the shutdown's error, not a silent end."""

    async def main():
        client = StuckClient()
        infer, allocator = make_infer(client)
        infer.start()
        running = asyncio.create_task(collect(infer, 200))
        await wait_for(lambda: client.method_calls("decode"))
        queued = asyncio.create_task(collect(infer, 200))  # the two together exceed the 256-token budget: it waits
        await wait_for(lambda: infer.queue_size == 1)
        await infer.stop(ShuttingDown())
        late = asyncio.create_task(collect(infer, 3))  # still being validated at the deadline
        for task in (running, queued, late):
            with pytest.raises(ShuttingDown, match=r"^Server is shutting down: "):
                await task
        assert allocator.free_blocks == 64 and infer.queue_size == 0

    asyncio.run(main())


def test_health_runs_a_probe_only_after_a_failure():
    async def main():
        client = FakeClient()
        infer, allocator = make_infer(client)
        infer.start()
        assert await infer.health() and not client.method_calls("prefill")
        client.fail_next["decode"] = "boom"
        with pytest.raises(GenerationError):
            await collect(infer, 3)
        assert await infer.health()
        probe = client.requests[client.method_calls("prefill")[-1][1][0]]
        assert list(probe.input_ids) == [0] and probe.stopping_parameters.max_new_tokens == 1
        client.fail_next["decode"] = "boom"
        with pytest.raises(GenerationError):
            await collect(infer, 3)
        client.fail_next["prefill"] = "still broken"
        assert not await infer.health()
        client.healthy = False
        assert not await infer.health()
        await infer.stop()
        assert allocator.free_blocks == 64

    asyncio.run(main())


def test_scheduler_config_is_validated():
    with pytest.raises(ValueError, match="max_batch_prefill_tokens must be <="):
        SchedulerConfig(max_batch_prefill_tokens=10, max_batch_total_tokens=5, block_size=4, num_blocks=4)
    with pytest.raises(ValueError, match="max_batch_size"):
        SchedulerConfig(
            max_batch_prefill_tokens=1, max_batch_total_tokens=5, max_batch_size=0, block_size=4, num_blocks=4
        )


@pytest.mark.parametrize("chunked", [True, False])
def test_a_prompt_longer_than_the_prefill_budget_runs_only_with_chunked_prefill(chunked):
    async def main():
        config = replace(CONFIG, max_batch_prefill_tokens=8, chunked_prefill=chunked)
        client = FakeClient()
        infer = Infer(client, config, BlockAllocator(config.num_blocks, config.block_size))
        infer.start()
        request = make_request(input_len=20, max_new=3)
        try:
            tokens = [e.token.id async for e in infer.generate(request) if isinstance(e, TokenEvent)]
        finally:
            await infer.stop()
        assert tokens == [1, 2, 3] and [sum(f[0].values()) for f in client.forwards[:3]] == [8, 8, 4]

    assert CONFIG.chunked_prefill, "chunked prefill is on by default"
    if chunked:
        asyncio.run(main())
    else:
        with pytest.raises(CapacityError, match="`inputs` tokens must be <= 8"):
            asyncio.run(main())
