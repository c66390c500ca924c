"""The batching loop (continuous batching): one asyncio task that drives the shards.

Each step: schedule (maybe take a new batch from the queue), execute and update (hand the tokens to the request
channels, free the blocks of finished and abandoned requests). New requests join between decode steps; nothing
waits for a batch to end.

Execute has two shapes. With chunked prefill (the default) a step is ONE forward: at most
`max_batch_prefill_tokens` new prompt tokens (the next chunk of the prompt being prefilled, then the first
chunks of newly admitted requests) plus one decode token of every other running request, so a long prompt
never stalls the running streams for more than one chunk. A request whose prompt is not complete stays in the
running batch and is never sampled (the shard produces no token for it). Without chunking (TGI's v2 rule) a new
batch is prefilled whole in its own forward, then everything running decodes one token.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import Protocol

from kettle.proto import generate_pb2 as pb
from kettle.router import metrics
from kettle.router.block_ledger import BlockLedger
from kettle.router.blocks import Allocator
from kettle.router.chunk_budget import ChunkBudget
from kettle.router.client import StepResult
from kettle.router.config import SchedulerConfig
from kettle.router.decode_steps import DecodeSteps
from kettle.router.events import generation_events
from kettle.router.liveness import Liveness
from kettle.router.queue import Entry, NextBatch, Queue
from kettle.router.tracing import batch_span
from kettle.router.types import GenerationError, InferError

logger = logging.getLogger(__name__)


class ShardClient(Protocol):
    """The shard calls the scheduler makes (`ShardedClient` in production, a scripted fake in tests)."""

    async def prefill(self, batch: pb.Batch, cached_batch: pb.CachedBatch | None = None) -> StepResult: ...

    async def decode(self, batches: Sequence[pb.CachedBatch], max_steps: int = 1) -> StepResult: ...

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
        self._chunks = ChunkBudget(config.max_batch_prefill_tokens, config.adaptive_chunks)
        self._decode_steps = DecodeSteps(config.decode_window_ms / 1000)
        self._call_steps = 1  # decode steps the last shard call ran
        self._wake = asyncio.Event()
        self.last_call_ok = True  # read by the health check
        self.ledger = BlockLedger(allocator)
        self.liveness = Liveness(config.stall_timeout)

    @property
    def running(self) -> int:
        return len(self._running)

    def wake(self) -> None:
        """Tells an idle loop that the queue changed."""
        if not self._running and len(self._queue) <= 1:  # work just reached an idle server
            self.liveness.work_arrived()
        self._wake.set()

    def stall(self) -> str | None:
        """Why the loop counts as wedged (for /health), or None."""
        return self.liveness.stall(has_work=bool(self._running) or len(self._queue) > 0)

    async def run(self) -> None:
        """The loop: step while there is work, sleep until `wake` when there is none.

        The step's outcome is settled here, in one place: whatever a step raised, every request it held gets an
        answer (or goes back to the queue if no shard ever saw it) and its blocks return to the pool; then the
        block ledger is checked against the live requests.
        """
        while True:
            self._wake.clear()  # before looking at the queue, so an append during the step is not missed
            self.liveness.step_started()
            try:
                busy = await self.step()
            except Exception as error:
                logger.exception("scheduler step failed")
                await self._fail_step(error)
                busy = True
            self.liveness.step_ended(busy)
            self.ledger.check(self._running.values())
            if not busy:
                await self._wake.wait()

    async def step(self) -> bool:
        """One iteration: schedule → execute → update. Returns False when there was nothing to do."""
        if self._config.chunked_prefill:
            return await self._mixed_step()
        new = self._own(self._schedule())
        batches = [self._batch] if self._batch is not None else []
        if new is not None:
            batches += await self._prefill(new)
        if batches:
            batch_ids = [b.id for b in batches]
            call = self._client.decode(batches, self._steps_allowed(new is None))
            decoded = await self._execute("decode", list(self._running), batch_ids, call)
            self._batch = decoded[0] if decoded else None
            self._waiting_steps += self._call_steps
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

    async def _mixed_step(self) -> bool:
        """Chunked prefill: prompt chunks and the running decodes in one forward (a Prefill with the cached batch
        when requests join, else a Decode)."""
        decoding = any(not e.in_prefill for e in self._running.values())
        budget, chunks = self._continue_prefills(self._chunks.tokens(decoding))
        prefilling = [e for e in self._running.values() if e.in_prefill]
        new = self._own(self._schedule_chunks(budget) if budget > 0 else None)
        if new is None and self._batch is None:
            self._update_gauges()
            return False
        running = self._with_chunks(self._batch, chunks)
        if new is None:
            assert running is not None
            call, method, batch_ids = (
                self._client.decode([running], self._steps_allowed(not chunks)),
                "decode",
                [running.id],
            )
        else:
            self._admit(new)
            prefilling += new.entries.values()
            call, method = self._client.prefill(new.batch, running), "prefill"
            batch_ids = [new.batch.id, *([running.id] if running is not None else [])]
        prompt_tokens, start = sum(e.chunk_len for e in prefilling), time.monotonic()
        decoded = await self._execute(method, list(self._running), batch_ids, self._progressed(prefilling, call))
        self._chunks.observe((time.monotonic() - start) / self._call_steps, prompt_tokens)
        self._batch = decoded[0] if decoded else None
        self._update_gauges()
        return True

    def _steps_allowed(self, nothing_joins: bool) -> int:
        """Decode steps the next call may run: several only while the batch is settled (see decode_steps.py)."""
        settled = (
            nothing_joins
            and len(self._queue) == 0
            and not any(e.in_prefill or e.cancelled for e in self._running.values())
        )
        return self._decode_steps.steps(settled)

    def _continue_prefills(self, budget: int) -> tuple[int, dict[int, int]]:
        """The next chunk of every running request whose prompt is incomplete, and what is left of `budget`.

        There is at most one such request: new requests are admitted only from the budget a step has left after
        the running prefill's chunk, which means that prefill completes in that very step.
        """
        chunks: dict[int, int] = {}
        for entry in self._running.values():
            if entry.in_prefill:
                entry.chunk_len = entry.next_chunk(budget)
                assert entry.chunk_len > 0, "a running prefill got no tokens of the budget"
                chunks[entry.id], budget = entry.chunk_len, budget - entry.chunk_len
                if entry.chunk_len < entry.remaining_prompt:
                    budget = 0  # a chunk cut before an image: nothing new joins until this prompt completes
        return budget, chunks

    def _schedule_chunks(self, prefill_budget: int) -> NextBatch | None:
        """New requests for what is left of this step's prefill budget (the last one may get only a chunk).

        No minimum batch size, unlike TGI's v2 rule: a step's cost is bounded by the prefill budget whatever
        joins, so waiting to gather a bigger batch would only delay first tokens.
        """
        cfg, running = self._config, len(self._running)
        max_size = None if cfg.max_batch_size is None else cfg.max_batch_size - running
        budget = cfg.max_batch_total_tokens - self.reserved_tokens()
        return self._queue.next_batch(None, max_size, prefill_budget, budget)

    @staticmethod
    def _with_chunks(batch: pb.CachedBatch | None, chunks: Mapping[int, int]) -> pb.CachedBatch | None:
        """The running batch as sent to the shards: with the next chunk of each request still in prefill."""
        if batch is None or not chunks:
            return batch
        sent = pb.CachedBatch()
        sent.CopyFrom(batch)
        sent.chunk_lens.update(chunks)
        return sent

    def reserved_tokens(self) -> int:
        """KV tokens the running requests may still fill (prompt + max_new_tokens each)."""
        return sum(e.total_tokens for e in self._running.values())

    async def _prefill(self, new: NextBatch) -> list[pb.CachedBatch]:
        self._admit(new)
        call = self._progressed(list(new.entries.values()), self._client.prefill(new.batch))
        return await self._execute("prefill", list(new.entries), [new.batch.id], call)

    def _own(self, new: NextBatch | None) -> NextBatch | None:
        """Entries taken from the queue belong to the running set at once, before anything else can fail: from
        here on a failed step answers for them and `_retire` is the one place that frees their blocks."""
        if new is not None:
            self._running.update(new.entries)
        return new

    def _admit(self, new: NextBatch) -> None:
        """New entries start their first forward: from now on a shard has seen them."""
        metrics.BATCH_NEXT_SIZE.observe(len(new.entries))
        now = time.monotonic()
        for entry in new.entries.values():
            entry.started_at, entry.sent = now, True
        self._waiting_steps = 1  # TGI counts the prefill itself as the first step

    async def _progressed(self, prefilling: Iterable[Entry], call: Awaitable[StepResult]) -> StepResult:
        """Awaits a forward, records the prompt tokens it computed, and lets later requests reuse the prompt
        blocks of every prompt it completed.

        Not before the forward succeeded, and not after a mere chunk: a block is shared only once its K/V are
        really there, so a failed forward (or a request in the same batch) never reads a block never written.
        """
        result = await call
        for entry in prefilling:
            entry.prefilled_len += entry.chunk_len or entry.remaining_prompt
            if not entry.in_prefill and entry.allocation is not None:
                self._allocator.commit(entry.allocation)
        return result

    async def _execute(
        self, method: str, entry_ids: list[int], batch_ids: list[int], call: Awaitable[StepResult]
    ) -> list[pb.CachedBatch]:
        """Awaits one shard call and hands out its results; a failure fails exactly the requests of that call."""
        try:
            with batch_span(method, entry_ids):  # a no-op unless tracing is on
                generations, cached = await self._timed(method, call)
            cached = await self._update(entry_ids, generations, cached)
        except Exception as error:  # any failure (shard, network, bad answer) must end this batch, not the loop
            logger.exception("%s failed for requests %s", method, entry_ids)
            await self._fail(entry_ids, batch_ids, error)
            return []
        return [cached] if cached is not None else []

    async def _timed(self, method: str, call: Awaitable[StepResult]) -> tuple[list, pb.CachedBatch | None]:
        """Awaits a prefill or decode, recording the batch metrics and whether the shards are healthy."""
        start = time.monotonic()
        try:
            generations, cached, timings = await call
        except Exception:
            metrics.BATCH_INFERENCE_COUNT.labels(method=method).inc()
            metrics.BATCH_INFERENCE_FAILURE.labels(method=method).inc()
            self.last_call_ok = False
            raise
        # The batch metrics count forwards: a decode call that ran several steps counts each, at its share.
        elapsed, self._call_steps = time.monotonic() - start, max(1, timings.steps if timings is not None else 1)
        for _ in range(self._call_steps):
            metrics.BATCH_INFERENCE_COUNT.labels(method=method).inc()
            metrics.BATCH_FORWARD_DURATION.labels(method=method).observe(elapsed / self._call_steps)
            metrics.BATCH_INFERENCE_SUCCESS.labels(method=method).inc()
        if method == "decode":
            self._decode_steps.observe(elapsed, self._call_steps)
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
        if generation.draft_tokens:  # speculative decoding: several tokens may have come in one step
            metrics.SPECULATIVE_DRAFT_TOKENS.inc(generation.draft_tokens)
            metrics.SPECULATIVE_ACCEPTED_TOKENS.inc(generation.accepted_tokens)
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

    async def _fail_step(self, error: Exception) -> None:
        """A step failed outside a shard call: requests no shard has seen go back to the queue (once: a request
        that fails two steps is failed, so a poison request cannot loop), every other one fails with a 424, and
        the shards drop every batch (they held only the requests now failed)."""
        unsent = [e for e in self._running.values() if not e.sent and e.requeued == 0]
        for entry in unsent:
            self._retire(entry.id)
        self._queue.requeue(unsent)
        await self._fail(list(self._running), [None], error)
        self._batch = None

    async def _fail(self, entry_ids: Iterable[int], batch_ids: Iterable[int | None], error: Exception) -> None:
        """Ends the given requests with a 424, frees their blocks and drops their batches on the shards."""
        failure = GenerationError(str(error) or type(error).__name__)
        for entry_id in entry_ids:
            if entry_id in self._running:
                self._retire(entry_id).fail(failure)
        for batch_id in batch_ids:
            try:
                await self._client.clear_cache(batch_id)
            except Exception:  # the shard may be gone; its batch is dropped on our side either way
                logger.exception("clear_cache(%s) failed", batch_id)

    def _update_gauges(self) -> None:
        metrics.BATCH_CURRENT_SIZE.set(len(self._running))
        metrics.BATCH_CURRENT_MAX_TOKENS.set(self.reserved_tokens())

    def shutdown(self, error: InferError | None = None) -> None:
        """Ends every queued and running request with `error`, or without a result (the server is stopping)."""
        for entry in [*self._queue.drain(), *(self._retire(entry_id) for entry_id in list(self._running))]:
            if error is None:
                entry.end_without_result()
            else:
                entry.fail(error)
        self._batch = None
