"""`Infer`: what the HTTP routes call. It queues requests, runs the scheduler task and streams events back."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import sys
from collections.abc import AsyncIterator
from typing import Protocol

from kettle.router import metrics
from kettle.router.blocks import Allocator, BlockAllocator
from kettle.router.client import DUMMY_TOKEN
from kettle.router.config import SchedulerConfig
from kettle.router.prefix_cache import PrefixCachingAllocator
from kettle.router.queue import Entry, Queue, batch_proto
from kettle.router.scheduler import Scheduler, ShardClient
from kettle.router.tracing import request_ended, request_queued
from kettle.router.types import (
    IncompleteGeneration,
    InferError,
    InferEvent,
    SamplingParameters,
    StoppingParameters,
    TokenEvent,
    ValidGenerateRequest,
)

logger = logging.getLogger(__name__)

# Request ids are unique for the life of the process: the shards key their batch state on them.
_REQUEST_IDS = itertools.count()


def make_allocator(config: SchedulerConfig) -> Allocator:
    """The KV block allocator the config asks for: prefix caching unless it was switched off."""
    if config.prefix_caching:
        return PrefixCachingAllocator(config.num_blocks, config.block_size)
    return BlockAllocator(config.num_blocks, config.block_size)


class InferClient(ShardClient, Protocol):
    """The scheduler's shard calls plus the health check."""

    async def health(self) -> None: ...


class Infer:
    """Queue + block allocator + scheduler task behind one interface for the route handlers."""

    def __init__(self, client: InferClient, config: SchedulerConfig, allocator: Allocator | None = None) -> None:
        self._client = client
        self._allocator = allocator or make_allocator(config)
        self._queue = Queue(
            self._allocator, config.max_batch_total_tokens, config.max_batch_prefill_tokens, config.chunked_prefill
        )
        self._scheduler = Scheduler(client, self._queue, self._allocator, config)
        self._task: asyncio.Task | None = None
        # Set by `stop(error)`: a request that reaches `generate` afterwards (it was still being validated at the
        # drain's deadline) gets the same error at once instead of waiting in a queue nothing serves.
        self._stopped_with: InferError | None = None
        metrics.track_kv_blocks(self._allocator)

    @property
    def queue_size(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        """Starts the scheduler task (on the running event loop)."""
        if self._task is None:
            self._task = asyncio.create_task(self._scheduler.run(), name="kettle-scheduler")

    async def stop(self, error: InferError | None = None) -> None:
        """Stops the scheduler; requests still queued or running end with `error` (IncompleteGeneration if None)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._stopped_with = error
        self._scheduler.shutdown(error)

    async def generate(self, request: ValidGenerateRequest) -> AsyncIterator[InferEvent]:
        """Queues `request` and yields its events until the last token.

        Raises the InferError the scheduler reported, or IncompleteGeneration when the request ended without a
        last token. Closing the generator early (the client went away) cancels the request: the scheduler drops
        it from the batch and frees its blocks at its next step.
        """
        if self._stopped_with is not None:
            raise self._stopped_with
        entry = Entry(next(_REQUEST_IDS), request)
        self._queue.append(entry)
        request_queued(entry.id)  # tracing: a no-op unless it is on
        self._scheduler.wake()
        try:
            while True:
                item = await entry.channel.get()
                if item is None:
                    raise IncompleteGeneration()
                if isinstance(item, InferError):
                    raise item
                yield item
                if isinstance(item, TokenEvent) and item.end is not None:
                    return
        finally:
            request_ended(entry.id, sys.exc_info()[1])
            if not entry.done:
                entry.cancelled = True
                self._scheduler.wake()

    async def health(self) -> bool:
        """True when the batching loop makes progress, every shard answers and, if the last shard call failed, a
        real forward works again."""
        stall = self._loop_stall()
        if stall is not None:
            logger.error("unhealthy: %s", stall)
            return False
        try:
            await self._client.health()
            if not self._scheduler.last_call_ok:
                await self._probe()
        except Exception:
            logger.warning("health check failed", exc_info=True)
            return False
        return True

    def _loop_stall(self) -> str | None:
        if self._task is not None and self._task.done():
            return "the scheduler loop has ended"
        return self._scheduler.stall()

    async def _probe(self) -> None:
        """A one-token prefill of a single request through every shard.

        It runs beside the scheduler's own calls (as TGI's does) and owns a real block, so it cannot overwrite
        the KV cache of a running request.
        """
        request = ValidGenerateRequest(
            inputs="",
            input_ids=(DUMMY_TOKEN,),
            truncate=None,
            decoder_input_details=False,
            top_n_tokens=0,
            parameters=SamplingParameters(),
            stopping=StoppingParameters(max_new_tokens=1),
        )
        entry = Entry(next(_REQUEST_IDS), request)
        entry.allocation = self._allocator.allocate(entry.total_tokens)
        if entry.allocation is None:
            raise RuntimeError("no free KV block for the health probe")
        self._scheduler.ledger.lent.add(entry.allocation)
        try:
            _, cached, _ = await self._client.prefill(batch_proto(self._queue.new_batch_id(), [entry]))
            if cached is not None:  # a one-token request ends at prefill; drop the batch if a shard kept it
                await self._client.clear_cache(cached.id)
            self._scheduler.last_call_ok = True
        finally:
            self._allocator.free(entry.allocation)
            self._scheduler.ledger.lent.discard(entry.allocation)
            self._scheduler.wake()  # the probe's block may be what a queued request was waiting for
