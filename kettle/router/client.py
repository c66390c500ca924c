"""The router's gRPC client to the shards: every call is broadcast to all ranks and the answers merged.

In a sharded run each rank reports generations only for its own requests (`id % world_size == rank`), so the
generations of all ranks are concatenated; batch facts (cached batch, timings) come from rank 0, which holds
the same batch state as every other rank.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kettle import tracing
from kettle.proto import generate_pb2 as pb
from kettle.proto import generate_pb2_grpc

# Prefill logprobs of long prompts in big batches make large messages; gRPC's 4 MB default is too small.
_MAX_MESSAGE = 256 * 1024 * 1024
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", _MAX_MESSAGE), ("grpc.max_receive_message_length", _MAX_MESSAGE)]
# Rank 0's socket may not exist yet (the launcher starts the router beside the shards): gRPC's default reconnect
# backoff (1 s, growing to 2 min) would answer seconds after the shard opens it; a local socket's failed connect
# costs microseconds, so retry it every 20 ms. Every start waits here for the shard's load: at 50-200 ms the
# router asked ~100 ms after the socket opened, on average, while the warm-up and the router's own start waited.
_DISCOVERY_OPTIONS = [
    *_CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 20),
    ("grpc.min_reconnect_backoff_ms", 20),
    ("grpc.max_reconnect_backoff_ms", 20),
]
# Warmup and health probes need some token the model knows; id 0 exists in every vocabulary.
DUMMY_TOKEN = 0


class ShardError(RuntimeError):
    """A shard call failed; the message is the shard's own description (it becomes the 424 cause)."""


@dataclass(frozen=True)
class Timings:
    """Where the time of one prefill or decode went on rank 0 (nanoseconds)."""

    forward_ns: int = 0
    decode_ns: int = 0
    total_ns: int = 0
    concat_ns: int = 0
    steps: int = 1  # decode steps the call ran


StepResult = tuple[list[pb.Generation], pb.CachedBatch | None, Timings]


def _channel_target(url: str) -> str:
    return url if "://" in url else f"unix://{url}"


def _merge_generations(responses: Sequence[Any]) -> list[pb.Generation]:
    """All ranks' generations, one per request (a rank that reports everything must not duplicate tokens)."""
    merged: dict[int, pb.Generation] = {}
    for response in responses:
        for generation in response.generations:
            merged.setdefault(generation.request_id, generation)
    return list(merged.values())


def _step_result(responses: Sequence[Any]) -> StepResult:
    first = responses[0]
    batch = first.batch if first.HasField("batch") else None
    concat = getattr(first, "concat_ns", 0)
    steps = max(1, getattr(first, "steps", 1))
    timings = Timings(first.forward_ns, first.decode_ns, first.total_ns, concat, steps)
    return _merge_generations(responses), batch, timings


def warmup_batch(
    max_input_tokens: int, max_prefill_tokens: int, max_total_tokens: int, max_batch_size: int | None
) -> pb.Batch:
    """The largest prefill the router may send: requests of dummy tokens filling `max_prefill_tokens`.

    Sampling, penalties, watermark, prefill logprobs and top-n are all on so that warmup measures the memory of
    every operation a real batch can use. Blocks are left empty: the shard sizes the KV cache after this.
    """
    requests = []
    n_tokens = 0
    while n_tokens < max_prefill_tokens and (max_batch_size is None or len(requests) < max_batch_size):
        length = min(max_input_tokens, max_prefill_tokens - n_tokens)
        requests.append(_warmup_request(len(requests), length, max_total_tokens - length))
        n_tokens += length
    return pb.Batch(id=0, requests=requests, size=len(requests), max_tokens=max_prefill_tokens, max_blocks=0)


def _warmup_request(request_id: int, length: int, max_new_tokens: int) -> pb.Request:
    parameters = pb.NextTokenChooserParameters(
        temperature=0.9, top_k=10, top_p=0.9, typical_p=0.9, do_sample=False, seed=0,
        repetition_penalty=1.2, frequency_penalty=0.1, watermark=True,
    )  # fmt: skip
    stopping = pb.StoppingCriteriaParameters(max_new_tokens=max(max_new_tokens, 1), ignore_eos_token=True)
    return pb.Request(
        id=request_id, input_ids=[DUMMY_TOKEN] * length, truncate=length, parameters=parameters,
        stopping_parameters=stopping, prefill_logprobs=True, top_n_tokens=5,
    )  # fmt: skip


class ShardedClient:
    """One gRPC channel per rank; each method sends the same message to all ranks concurrently."""

    def __init__(self, channels: list[grpc.aio.Channel]) -> None:
        self._channels = channels
        self._stubs = [generate_pb2_grpc.TextGenerationServiceStub(c) for c in channels]

    @classmethod
    async def connect(cls, master_uds_path: str, timeout: float | None = 60.0) -> ShardedClient:
        """Asks rank 0 (at `master_uds_path`) for every rank's socket and connects to all of them, waiting up to
        `timeout` seconds (None: without end) for rank 0 to open its socket."""
        master = grpc.aio.insecure_channel(_channel_target(master_uds_path), options=_DISCOVERY_OPTIONS)
        try:
            stub = generate_pb2_grpc.TextGenerationServiceStub(master)
            call = stub.ServiceDiscovery(pb.ServiceDiscoveryRequest(), timeout=timeout, wait_for_ready=True)
            response = await _checked(call)
        finally:
            await master.close()
        # With tracing on, an interceptor carries each call's trace context to the shards (kettle/tracing.py).
        channels = [
            grpc.aio.insecure_channel(
                _channel_target(u), options=_CHANNEL_OPTIONS, interceptors=tracing.client_interceptors()
            )
            for u in response.urls
        ]
        try:
            # Ranks started by another launcher (--nnodes) may open their sockets a little after rank 0.
            await asyncio.wait_for(asyncio.gather(*(c.channel_ready() for c in channels)), timeout)
        except TimeoutError:
            raise ShardError(f"not every shard of {list(response.urls)} answered within {timeout:.0f} s") from None
        return cls(channels)

    @property
    def world_size(self) -> int:
        return len(self._stubs)

    async def _broadcast(self, call: Callable[[generate_pb2_grpc.TextGenerationServiceStub], Awaitable]) -> list:
        return await asyncio.gather(*(_checked(call(stub)) for stub in self._stubs))

    async def info(self) -> pb.InfoResponse:
        return (await self._broadcast(lambda s: s.Info(pb.InfoRequest())))[0]

    async def health(self) -> None:
        """Raises ShardError when any shard does not answer."""
        await self._broadcast(lambda s: s.Health(pb.HealthRequest()))

    async def resident_memory(self) -> list[int]:
        """Each rank's resident memory in bytes (0: unknown), in rank order: Health answers carry it."""
        answers = await self._broadcast(lambda s: s.Health(pb.HealthRequest()))
        return [answer.resident_memory_bytes for answer in answers]

    async def warmup(
        self, max_input_tokens: int, max_prefill_tokens: int, max_total_tokens: int, max_batch_size: int | None
    ) -> pb.WarmupResponse:
        """Runs the largest prefill on every shard; the answer holds the limits all of them support."""
        request = pb.WarmupRequest(
            batch=warmup_batch(max_input_tokens, max_prefill_tokens, max_total_tokens, max_batch_size),
            max_input_tokens=max_input_tokens,
            max_prefill_tokens=max_prefill_tokens,
            max_total_tokens=max_total_tokens,
        )
        responses = await self._broadcast(lambda s: s.Warmup(request))
        merged = pb.WarmupResponse()
        merged.CopyFrom(responses[0])
        merged.max_supported_total_tokens = min(r.max_supported_total_tokens for r in responses)
        merged.num_blocks = min(r.num_blocks for r in responses)
        return merged

    async def prefill(self, batch: pb.Batch, cached_batch: pb.CachedBatch | None = None) -> StepResult:
        request = pb.PrefillRequest(batch=batch, cached_batch=cached_batch)
        return _step_result(await self._broadcast(lambda s: s.Prefill(request)))

    async def decode(self, batches: Sequence[pb.CachedBatch], max_steps: int = 1) -> StepResult:
        request = pb.DecodeRequest(batches=batches, max_steps=max_steps)
        return _step_result(await self._broadcast(lambda s: s.Decode(request)))

    async def filter_batch(self, batch_id: int, request_ids: Sequence[int]) -> pb.CachedBatch | None:
        request = pb.FilterBatchRequest(batch_id=batch_id, request_ids=request_ids)
        first = (await self._broadcast(lambda s: s.FilterBatch(request)))[0]
        return first.batch if first.HasField("batch") else None

    async def clear_cache(self, batch_id: int | None = None) -> None:
        await self._broadcast(lambda s: s.ClearCache(pb.ClearCacheRequest(id=batch_id)))

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels))


async def _checked(call: Awaitable) -> Any:
    """Awaits one RPC, turning gRPC's error into a ShardError that carries just the shard's message."""
    try:
        return await call
    except grpc.aio.AioRpcError as error:
        raise ShardError(error.details() or error.code().name) from error
