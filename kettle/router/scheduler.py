"""The batching loop (continuous batching): one asyncio task that drives the shards.

Each step: schedule (maybe take a new batch from the queue), execute (prefill the new batch, then one decode
step over everything running) and update (hand the tokens to the request channels, free the blocks of
finished and abandoned requests). New requests join between decode steps; nothing waits for a batch to end.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from kettle.proto import generate_pb2 as pb
from kettle.router import metrics
from kettle.router.blocks import Allocator
from kettle.router.client import StepResult
from kettle.router.queue import Entry, NextBatch, Queue
from kettle.router.types import (
    FinishReason,
    GeneratedText,
    GenerationError,
    InferEvent,
    PrefillEvent,
    Token,
    TokenEvent,
)

if TYPE_CHECKING:
    from kettle.router.infer import SchedulerConfig

logger = logging.getLogger(__name__)

_FINISH_REASONS = {
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_EOS_TOKEN: FinishReason.EOS_TOKEN,
    pb.FINISH_REASON_STOP_SEQUENCE: FinishReason.STOP_SEQUENCE,
}


class ShardClient(Protocol):
    """The shard calls the scheduler makes (`ShardedClient` in production, a scripted fake in tests)."""

    async def prefill(self, batch: pb.Batch, cached_batch: pb.CachedBatch | None = None) -> StepResult: ...

    async def decode(self, batches: Sequence[pb.CachedBatch]) -> StepResult: ...

    async def filter_batch(self, batch_id: int, request_ids: Sequence[int]) -> pb.CachedBatch | None: ...

    async def clear_cache(self, batch_id: int | None = None) -> None: ...


class Scheduler:
    """Owns the running batch: which entries are in it, the shards' cached batch, and when new ones join."""

    def __init__(self, client: ShardClient, queue: Queue, allocator: Allocator, config: SchedulerConfig) -> None:
        self._client = client
        self._queue = queue
        self._allocator = allocator
        self._config = config
        self._running: dict[int, Entry] = {}
        self._batch: pb.CachedBatch | None = None
        self._waiting_steps = 0  # steps since a batch last joined (TGI's `waiting_tokens`)
        self._wake = asyncio.Event()
        self.last_call_ok = True  # read by the health check

    @property
    def running(self) -> int:
        return len(self._running)

    def wake(self) -> None:
        """Tells an idle loop that the queue changed."""
        self._wake.set()

    async def run(self) -> None:
        """The loop: step while there is work, sleep until `wake` when there is none."""
        while True:
            self._wake.clear()  # before looking at the queue, so an append during the step is not missed
            try:
                busy = await self.step()
            except Exception as error:  # a bug must not leave every request hanging: fail the running ones
                logger.exception("scheduler step failed")
                await self._fail(list(self._running), [self._batch.id] if self._batch else [], error)
                self._batch, busy = None, True
            if not busy:
                await self._wake.wait()

    async def step(self) -> bool:
        """One iteration: schedule → execute → update. Returns False when there was nothing to do."""
        new = self._schedule()
        batches = [self._batch] if self._batch is not None else []
        if new is not None:
            batches += await self._prefill(new)
        if batches:
            batch_ids = [b.id for b in batches]
            decoded = await self._execute("decode", list(self._running), batch_ids, self._client.decode(batches))
            self._batch = decoded[0] if decoded else None
            self._waiting_steps += 1
        self._update_gauges()
        return new is not None or bool(batches)

    def _schedule(self) -> NextBatch | None:
        """The TGI rule: a new batch joins a running one when it is big enough or has waited long enough."""
        cfg, running = self._config, len(self._running)
        min_size = None
        if running and self._waiting_steps < cfg.max_waiting_tokens:
            min_size = math.floor(running * cfg.waiting_served_ratio)
        max_size = None if cfg.max_batch_size is None else cfg.max_batch_size - running
        budget = cfg.max_batch_total_tokens - self.reserved_tokens()
        return self._queue.next_batch(min_size, max_size, cfg.max_batch_prefill_tokens, budget)

    def reserved_tokens(self) -> int:
        """KV tokens the running requests may still fill (prompt + max_new_tokens each)."""
        return sum(e.total_tokens for e in self._running.values())

    async def _prefill(self, new: NextBatch) -> list[pb.CachedBatch]:
        metrics.BATCH_NEXT_SIZE.observe(len(new.entries))
        now = time.monotonic()
        for entry in new.entries.values():
            entry.started_at = now
        self._running.update(new.entries)
        self._waiting_steps = 1  # TGI counts the prefill itself as the first step
        call = self._committed(new, self._client.prefill(new.batch))
        return await self._execute("prefill", list(new.entries), [new.batch.id], call)

    async def _committed(self, new: NextBatch, call: Awaitable[StepResult]) -> StepResult:
        """Awaits a prefill, then lets later requests reuse the prompt blocks it wrote.

        Not before: a block is shared only once its K/V are really there, so a failed prefill (or a request in
        the same batch) never reads a block that was never written.
        """
        result = await call
        for entry in new.entries.values():
            if entry.allocation is not None:
                self._allocator.commit(entry.allocation)
        return result

    async def _execute(
        self, method: str, entry_ids: list[int], batch_ids: list[int], call: Awaitable[StepResult]
    ) -> list[pb.CachedBatch]:
        """Awaits one shard call and hands out its results; a failure fails exactly the requests of that call."""
        try:
            generations, cached = await self._timed(method, call)
            cached = await self._update(entry_ids, generations, cached)
        except Exception as error:  # any failure (shard, network, bad answer) must end this batch, not the loop
            logger.exception("%s failed for requests %s", method, entry_ids)
            await self._fail(entry_ids, batch_ids, error)
            return []
        return [cached] if cached is not None else []

    async def _timed(self, method: str, call: Awaitable[StepResult]) -> tuple[list, pb.CachedBatch | None]:
        """Awaits a prefill or decode, recording the batch metrics and whether the shards are healthy."""
        metrics.BATCH_INFERENCE_COUNT.labels(method=method).inc()
        start = time.monotonic()
        try:
            generations, cached, _timings = await call
        except Exception:
            metrics.BATCH_INFERENCE_FAILURE.labels(method=method).inc()
            self.last_call_ok = False
            raise
        metrics.BATCH_FORWARD_DURATION.labels(method=method).observe(time.monotonic() - start)
        metrics.BATCH_INFERENCE_SUCCESS.labels(method=method).inc()
        self.last_call_ok = True
        return generations, cached

    async def _update(
        self, entry_ids: list[int], generations: Iterable[pb.Generation], cached: pb.CachedBatch | None
    ) -> pb.CachedBatch | None:
        """Fans the generations out, then drops from the shards' batch every request that must not go on."""
        for generation in generations:
            self._deliver(generation)
        held = set(cached.request_ids) if cached is not None else set()
        for entry_id in entry_ids:
            # The shard no longer holds it, yet it never finished: the reader gets IncompleteGeneration.
            if entry_id in self._running and entry_id not in held:
                self._retire(entry_id).end_without_result()
        return await self._drop_cancelled(cached)

    def _deliver(self, generation: pb.Generation) -> None:
        entry = self._running.get(generation.request_id)
        if entry is None:  # finished or failed already
            return
        for event in generation_events(generation, entry):
            entry.send(event)
        if generation.HasField("generated_text"):
            self._retire(entry.id).end_without_result()  # a no-op when the last event was sent

    async def _drop_cancelled(self, cached: pb.CachedBatch | None) -> pb.CachedBatch | None:
        """Removes requests whose client went away from the shards' batch and frees their blocks now."""
        if cached is None:
            return None
        gone = [i for i in cached.request_ids if i not in self._running or self._running[i].cancelled]
        if not gone:
            return cached
        for entry_id in gone:
            if entry_id in self._running:
                self._retire(entry_id)
        keep = [i for i in cached.request_ids if i in self._running]
        if not keep:
            await self._client.clear_cache(cached.id)
            return None
        return await self._client.filter_batch(cached.id, keep)

    def _retire(self, entry_id: int) -> Entry:
        """Takes an entry out of the running set and frees its blocks."""
        entry = self._running.pop(entry_id)
        if entry.allocation is not None:
            self._allocator.free(entry.allocation)
            entry.allocation = None
        return entry

    async def _fail(self, entry_ids: Iterable[int], batch_ids: Iterable[int], error: Exception) -> None:
        """Ends the given requests with a 424, frees their blocks and drops their batches on the shards."""
        failure = GenerationError(str(error) or type(error).__name__)
        for entry_id in entry_ids:
            if entry_id in self._running:
                self._retire(entry_id).fail(failure)
        for batch_id in batch_ids:
            try:
                await self._client.clear_cache(batch_id)
            except Exception:  # the shard may be gone; its batch is dropped on our side either way
                logger.exception("clear_cache(%d) failed", batch_id)

    def _update_gauges(self) -> None:
        metrics.BATCH_CURRENT_SIZE.set(len(self._running))
        metrics.BATCH_CURRENT_MAX_TOKENS.set(self.reserved_tokens())

    def shutdown(self) -> None:
        """Ends every queued and running request without a result (the server is stopping)."""
        for entry in self._queue.drain():
            entry.end_without_result()
        for entry_id in list(self._running):
            self._retire(entry_id).end_without_result()
        self._batch = None


def generation_events(generation: pb.Generation, entry: Entry) -> list[InferEvent]:
    """The events of one shard Generation: the prompt tokens if present, then one TokenEvent per new token."""
    events: list[InferEvent] = []
    if generation.prefill_tokens.ids:
        events.append(PrefillEvent(tuple(_tokens(generation.prefill_tokens))))
    tokens = _tokens(generation.tokens)
    finished = generation.HasField("generated_text")
    for i, token in enumerate(tokens):
        top = tuple(_tokens(generation.top_tokens[i])) if i < len(generation.top_tokens) else ()
        if finished and i == len(tokens) - 1:
            end = _generated_text(generation.generated_text)
            events.append(TokenEvent(token, top, end, queued_at=entry.queued_at, started_at=entry.started_at))
        else:
            events.append(TokenEvent(token, top))
    return events


def _tokens(tokens: pb.Tokens) -> list[Token]:
    """Tokens from the proto's parallel lists; a NaN logprob (the first prompt token) becomes None."""
    result = []
    for i, token_id in enumerate(tokens.ids):
        logprob = tokens.logprobs[i] if i < len(tokens.logprobs) else math.nan
        text = tokens.texts[i] if i < len(tokens.texts) else ""
        special = tokens.is_special[i] if i < len(tokens.is_special) else False
        result.append(Token(token_id, text, None if math.isnan(logprob) else logprob, special))
    return result


def _generated_text(text: pb.GeneratedText) -> GeneratedText:
    seed = text.seed if text.HasField("seed") else None
    return GeneratedText(text.text, text.generated_tokens, _FINISH_REASONS[text.finish_reason], seed)
