"""The shard hands freed memory back only once it has been idle a while: after a model call that left the engine
without batches and no call for `IDLE_SECONDS`, never while calls keep coming or a batch is cached."""

from __future__ import annotations

import asyncio

import pytest

from kettle.proto import generate_pb2 as pb
from kettle.shard import service as shard_service
from kettle.shard.service import ENGINE_THREAD, ShardService

IDLE = 0.05


class FakeEngine:
    """The engine's surface the service uses: cached batches, look-ahead and settle, counted."""

    def __init__(self) -> None:
        self.batches: dict[int, object] = {}
        self.settled = 0

    def look_ahead(self) -> None:
        pass

    def settle(self) -> None:
        self.settled += 1

    def call(self, keeps_a_batch: bool) -> None:
        """A model call that leaves a batch cached or none."""
        self.batches = {1: object()} if keeps_a_batch else {}


@pytest.fixture
def idle_seconds(monkeypatch):
    monkeypatch.setattr(shard_service, "IDLE_SECONDS", IDLE)


async def settled_after(engine: FakeEngine, service: ShardService, calls: list[bool], gap: float, wait: float) -> int:
    for keeps_a_batch in calls:
        await service._call(None, engine.call, keeps_a_batch)
        await asyncio.sleep(gap)
    await asyncio.sleep(wait)
    await asyncio.wrap_future(ENGINE_THREAD.submit(lambda: None))  # what the timer queued has run
    return engine.settled


def run(calls: list[bool], gap: float, wait: float) -> int:
    engine = FakeEngine()
    service = ShardService(engine, pb.InfoResponse(), [])
    return asyncio.run(settled_after(engine, service, calls, gap, wait))


def test_an_idle_engine_settles_once_after_the_idle_time(idle_seconds):
    assert run([False], gap=0, wait=0) == 0
    assert run([False], gap=0, wait=4 * IDLE) == 1
    assert run([True, True, False], gap=0, wait=4 * IDLE) == 1


def test_calls_coming_faster_than_the_idle_time_never_settle(idle_seconds):
    assert run([False] * 8, gap=IDLE / 5, wait=0) == 0


def test_an_engine_holding_a_batch_never_settles(idle_seconds):
    assert run([False, True], gap=0, wait=4 * IDLE) == 0
