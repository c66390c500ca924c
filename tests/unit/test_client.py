"""`ShardedClient` over real gRPC: two in-process fake shards on temporary Unix sockets."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import grpc
import pytest

from kettle.proto import generate_pb2 as pb
from kettle.proto import generate_pb2_grpc
from kettle.router.client import ShardedClient, ShardError, warmup_batch


class FakeShard(generate_pb2_grpc.TextGenerationServiceServicer):
    """Rank `rank` of `urls`: reports generations only for its own requests, like a real sharded run."""

    def __init__(self, rank: int, urls: list[str]) -> None:
        self.rank, self.urls = rank, urls
        self.seen: list[tuple[str, object]] = []

    async def ServiceDiscovery(self, request, context):
        return pb.ServiceDiscoveryResponse(urls=self.urls)

    async def Health(self, request, context):
        return pb.HealthResponse(resident_memory_bytes=(100 + self.rank) * 2**20)

    async def Prefill(self, request, context):
        batch = request.batch
        mine = [r for r in batch.requests if r.id % len(self.urls) == self.rank]
        generations = [pb.Generation(request_id=r.id, tokens=pb.Tokens(ids=[r.input_ids[-1] + 1])) for r in mine]
        cached = pb.CachedBatch(id=batch.id, request_ids=[r.id for r in batch.requests], size=len(batch.requests))
        return pb.PrefillResponse(generations=generations, batch=cached, forward_ns=10 + self.rank)

    async def Decode(self, request, context):
        await context.abort(grpc.StatusCode.INTERNAL, f"rank {self.rank} ran out of memory")

    async def Warmup(self, request, context):
        self.seen.append(("warmup", request))
        return pb.WarmupResponse(max_supported_total_tokens=1000 - 100 * self.rank, num_blocks=60 - self.rank)

    async def ClearCache(self, request, context):
        self.seen.append(("clear", request.id if request.HasField("id") else None))
        return pb.ClearCacheResponse()

    async def FilterBatch(self, request, context):
        return pb.FilterBatchResponse(batch=pb.CachedBatch(id=request.batch_id, request_ids=request.request_ids))


async def serve(paths: list[str]) -> tuple[list[grpc.aio.Server], list[FakeShard]]:
    servers, shards = [], []
    for rank, path in enumerate(paths):
        server, shard = grpc.aio.server(), FakeShard(rank, paths)
        generate_pb2_grpc.add_TextGenerationServiceServicer_to_server(shard, server)
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        servers.append(server)
        shards.append(shard)
    return servers, shards


@pytest.fixture
def socket_dir():
    path = tempfile.mkdtemp(prefix="kettle-")  # short: Unix socket paths are limited to ~100 characters
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


def test_discovery_broadcast_and_merged_answers(socket_dir):
    async def main():
        paths = [str(socket_dir / f"shard-{rank}") for rank in range(2)]
        servers, shards = await serve(paths)
        client = await ShardedClient.connect(paths[0])
        try:
            assert client.world_size == 2
            await client.health()
            assert await client.resident_memory() == [100 * 2**20, 101 * 2**20]  # rank order
            requests = [pb.Request(id=i, input_ids=[10 * i]) for i in range(4)]
            generations, cached, timings = await client.prefill(pb.Batch(id=7, requests=requests, size=4))
            assert sorted((g.request_id, g.tokens.ids[0]) for g in generations) == [(0, 1), (1, 11), (2, 21), (3, 31)]
            assert cached.id == 7 and list(cached.request_ids) == [0, 1, 2, 3] and timings.forward_ns == 10
            assert list((await client.filter_batch(7, [1, 3])).request_ids) == [1, 3]
            await client.clear_cache()
            await client.clear_cache(7)
            assert [s.seen for s in shards] == [[("clear", None), ("clear", 7)]] * 2
            with pytest.raises(ShardError, match="ran out of memory"):
                await client.decode([cached])
        finally:
            await client.close()
            await asyncio.gather(*(s.stop(None) for s in servers))

    asyncio.run(main())


def test_a_router_started_before_the_shard_connects_as_soon_as_it_serves(socket_dir):
    """The launcher starts the router beside the shards: discovery waits for rank 0's socket to appear, and
    answers within a fraction of a second of it (gRPC's default backoff would retry only after 1, 2.6, 5.1 s...)."""

    async def main():
        path = str(socket_dir / "shard-0")
        connecting = asyncio.create_task(ShardedClient.connect(path, timeout=None))
        await asyncio.sleep(1.5)  # past the first default retries
        assert not connecting.done()
        servers, _ = await serve([path])
        opened = asyncio.get_running_loop().time()
        client = await connecting
        waited = asyncio.get_running_loop().time() - opened
        try:
            assert client.world_size == 1 and waited < 0.5
        finally:
            await client.close()
            await asyncio.gather(*(s.stop(None) for s in servers))

    asyncio.run(main())


def test_warmup_sends_the_largest_prefill_and_takes_the_smallest_limits(socket_dir):
    async def main():
        paths = [str(socket_dir / f"shard-{rank}") for rank in range(2)]
        servers, shards = await serve(paths)
        client = await ShardedClient.connect(paths[0])
        try:
            response = await client.warmup(10, 25, 40, max_batch_size=None)
            assert (response.max_supported_total_tokens, response.num_blocks) == (900, 59)
            batch = shards[1].seen[0][1].batch
            assert [len(r.input_ids) for r in batch.requests] == [10, 10, 5]
            assert [r.stopping_parameters.max_new_tokens for r in batch.requests] == [30, 30, 35]
        finally:
            await client.close()
            await asyncio.gather(*(s.stop(None) for s in servers))

    asyncio.run(main())


def test_warmup_batch_respects_max_batch_size():
    batch = warmup_batch(max_input_tokens=8, max_prefill_tokens=100, max_total_tokens=16, max_batch_size=3)
    assert batch.size == 3 and [len(r.input_ids) for r in batch.requests] == [8, 8, 8]
    assert len({r.id for r in batch.requests}) == 3
    assert all(r.stopping_parameters.ignore_eos_token for r in batch.requests)


def test_resident_memory_gauges_name_each_process():
    import os
    import re

    from kettle.router import metrics

    metrics.track_process_memory(os.getppid())  # any other live process stands for the launcher
    metrics.record_shard_memory([100 * 2**20, 0])
    text = metrics.render().decode()
    values = dict(re.findall(r'^kettle_process_resident_memory_bytes\{process="([\w-]+)"\} (\S+)$', text, re.M))
    assert float(values["router"]) > 10 * 2**20 and float(values["launcher"]) > 0
    assert float(values["shard-0"]) == 100 * 2**20 and values["shard-1"] == "NaN"  # 0: the shard could not read it
