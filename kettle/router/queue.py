"""The waiting line: requests wait here, in order, until the scheduler takes them into a batch.

`Queue.next_batch` follows TGI v3: take entries in arrival order while the prefill budget, the total token
budget, the batch size and the KV block allocator allow. The first entry that does not fit ends the batch and
keeps its place (it is never dropped, and nothing behind it jumps ahead, so a large request cannot starve).
With chunked prefill, the first entry whose prompt exceeds what is left of the prefill budget is taken anyway
with a first chunk of exactly that much (less, or more when that would end inside an image its model computes
whole: chunk_spans.py); the scheduler sends the rest of its prompt in the following steps.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from kettle.proto import generate_pb2
from kettle.router.blocks import Allocation, Allocator
from kettle.router.chunk_spans import chunk_length
from kettle.router.metrics import PREFIX_CACHE_HIT_TOKENS, QUEUE_SIZE
from kettle.router.types import InferError, InferEvent, TokenEvent, ValidGenerateRequest

# What a response channel carries: events, then the InferError that ended the request or None (no result).
ChannelItem = InferEvent | InferError | None


class CapacityError(InferError):
    """A request that could never be scheduled, whatever else finishes (422, like validation errors)."""

    status = 422
    error_type = "validation"

    def __init__(self, message: str) -> None:
        Exception.__init__(self, f"Input validation error: {message}")


class UnplaceableRequest(CapacityError):
    """A request the shards cannot be sent (its blocks or its proto could not be built): it fails alone.

    Validation refuses such requests at the edge; this is the backstop that keeps one of them from failing, or
    wedging, the batch it would have joined.
    """

    def __init__(self, error: Exception) -> None:
        super().__init__(f"the request cannot be scheduled ({type(error).__name__}: {error})")


@dataclass(eq=False)
class Entry:
    """One request from arrival to its last token: the request, its response channel and its KV blocks."""

    id: int
    request: ValidGenerateRequest
    channel: asyncio.Queue[ChannelItem] = field(default_factory=asyncio.Queue)
    queued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None  # when the prefill of its batch began
    allocation: Allocation | None = None
    # Prompt tokens whose K/V are in the cache: the shared prefix at admission, then chunked-prefill progress.
    prefilled_len: int = 0
    chunk_len: int = 0  # prompt tokens its next forward computes (0 = all that remain)
    cancelled: bool = False  # the client went away: the scheduler drops it at the next step
    done: bool = False  # its last event or its error was sent
    sent: bool = False  # a shard call that includes it has started: from then on a failed step fails it
    requeued: int = 0  # times a failed step put it back in the queue (it had not reached a shard)

    @property
    def in_prefill(self) -> bool:
        """True while part of its prompt is still to be computed (a chunked prefill in progress)."""
        return self.prefilled_len < self.request.input_length

    @property
    def remaining_prompt(self) -> int:
        """Prompt tokens not yet in the KV cache."""
        return self.request.input_length - self.prefilled_len

    def next_chunk(self, budget: int) -> int:
        """Prompt tokens its next forward computes out of `budget` (> 0): what remains, at most `budget`, never
        ending inside an image its model computes whole (`chunk_spans.chunk_length`)."""
        spans = [(i.start, i.start + i.length) for i in self.request.images if i.whole]
        return chunk_length(self.prefilled_len, min(self.remaining_prompt, budget), spans)

    @property
    def total_tokens(self) -> int:
        """KV tokens this request can ever need."""
        return self.request.input_length + self.request.stopping.max_new_tokens

    def send(self, event: InferEvent) -> None:
        if not self.cancelled and not self.done:
            self.channel.put_nowait(event)
            self.done = isinstance(event, TokenEvent) and event.end is not None

    def fail(self, error: InferError) -> None:
        self._close(error)

    def end_without_result(self) -> None:
        """The request left the batch without a last token: the reader raises IncompleteGeneration."""
        self._close(None)

    def _close(self, item: InferError | None) -> None:
        if not self.done:
            self.done = True
            self.channel.put_nowait(item)

    def to_proto(self) -> generate_pb2.Request:
        """The shard's view of this request; needs an allocation."""
        assert self.allocation is not None, "a request is sent to the shards only once it holds blocks"
        request = self.request
        p, s = request.parameters, request.stopping
        return generate_pb2.Request(
            id=self.id,
            inputs=request.inputs,
            input_ids=request.input_ids,
            truncate=request.truncate or 0,
            parameters=generate_pb2.NextTokenChooserParameters(
                temperature=p.temperature,
                top_k=p.top_k,
                top_p=p.top_p,
                typical_p=p.typical_p,
                do_sample=p.do_sample,
                seed=p.seed,
                repetition_penalty=p.repetition_penalty,
                frequency_penalty=p.frequency_penalty,
                watermark=p.watermark,
                grammar=p.grammar,
                grammar_type=p.grammar_type,
                presence_penalty=p.presence_penalty,
            ),
            stopping_parameters=generate_pb2.StoppingCriteriaParameters(
                max_new_tokens=s.max_new_tokens, stop_sequences=s.stop_sequences, ignore_eos_token=s.ignore_eos_token
            ),
            prefill_logprobs=request.decoder_input_details,
            top_n_tokens=request.top_n_tokens,
            blocks=self.allocation.blocks,
            slots=self.allocation.slots,
            cache_len=self.prefilled_len,
            chunk_len=self.chunk_len,
            adapter_id=request.adapter_id or "",
            images=[
                generate_pb2.Image(data=i.data, digest=i.digest, start=i.start, length=i.length) for i in request.images
            ],
        )


@dataclass
class NextBatch:
    """A new batch taken from the queue: its entries (by request id) and the proto to prefill."""

    entries: dict[int, Entry]
    batch: generate_pb2.Batch


def batch_proto(
    batch_id: int, entries: list[Entry], requests: list[generate_pb2.Request] | None = None
) -> generate_pb2.Batch:
    """A proto batch of entries that hold their blocks (`requests`: their protos, when already built)."""
    requests = [e.to_proto() for e in entries] if requests is None else requests
    return generate_pb2.Batch(
        id=batch_id,
        requests=requests,
        size=len(requests),
        max_tokens=sum(e.total_tokens for e in entries),
        max_blocks=max((len(r.blocks) for r in requests), default=0),
    )


class Queue:
    """FIFO of entries waiting for KV blocks and a place in a batch.

    `max_total_tokens` / `max_prefill_tokens` are the scheduler's budgets: a request that exceeds them (or the
    allocator's whole capacity) on its own could never run, so `append` rejects it instead of queueing it.
    With `chunked` prefill a prompt longer than the prefill budget is fine: it is computed in pieces.
    """

    def __init__(
        self,
        allocator: Allocator,
        max_total_tokens: int | None = None,
        max_prefill_tokens: int | None = None,
        chunked: bool = False,
    ) -> None:
        self._allocator = allocator
        self._max_total = min(allocator.capacity, max_total_tokens or allocator.capacity)
        self._max_prefill = None if chunked else max_prefill_tokens
        self._chunked = chunked
        self._entries: deque[Entry] = deque()
        self._batch_ids = itertools.count()

    def __len__(self) -> int:
        return len(self._entries)

    def new_batch_id(self) -> int:
        return next(self._batch_ids)

    def append(self, entry: Entry) -> None:
        """Queues `entry`; raises CapacityError when it could never be scheduled."""
        self._check_fits(entry)
        self._entries.append(entry)
        QUEUE_SIZE.set(len(self._entries))

    def _check_fits(self, entry: Entry) -> None:
        inputs, new = entry.request.input_length, entry.request.stopping.max_new_tokens
        if inputs + new > self._max_total:
            raise CapacityError(
                f"`inputs` tokens + `max_new_tokens` must be <= {self._max_total}. "
                f"Given: {inputs} `inputs` tokens and {new} `max_new_tokens`"
            )
        if self._max_prefill is not None and inputs > self._max_prefill:
            raise CapacityError(f"`inputs` tokens must be <= {self._max_prefill}. Given: {inputs}")

    def drain(self) -> list[Entry]:
        """Removes and returns every waiting entry (at shutdown)."""
        entries, self._entries = list(self._entries), deque()
        QUEUE_SIZE.set(0)
        return entries

    def next_batch(
        self, min_size: int | None, max_size: int | None, prefill_token_budget: int, token_budget: int
    ) -> NextBatch | None:
        """The longest prefix of the queue that fits the budgets, or None (fewer than `min_size`, or nothing fits).

        `prefill_token_budget` bounds the prompt tokens computed; `token_budget` bounds the KV tokens the new
        batch reserves (prompt + max_new_tokens). Cancelled entries met on the way are discarded.
        """
        if max_size is not None and max_size <= 0:
            return None
        taken = self._take(max_size, prefill_token_budget, token_budget)
        if not taken or (min_size is not None and len(taken) < min_size):
            self._put_back(taken)
            return None
        QUEUE_SIZE.set(len(self._entries))
        taken, requests = self._encoded(taken)
        if not taken:
            return None
        PREFIX_CACHE_HIT_TOKENS.inc(sum(e.prefilled_len for e in taken))
        return NextBatch({e.id: e for e in taken}, batch_proto(self.new_batch_id(), taken, requests))

    def _encoded(self, taken: list[Entry]) -> tuple[list[Entry], list[generate_pb2.Request]]:
        """The entries whose shard request could be built, with those requests; the others fail alone."""
        kept, requests = [], []
        for entry in taken:
            try:
                requests.append(entry.to_proto())
            except Exception as error:  # a value the proto cannot carry: this request's fault, not the batch's
                self._reject(entry, error)
                continue
            kept.append(entry)
        return kept, requests

    def _reject(self, entry: Entry, error: Exception) -> None:
        if entry.allocation is not None:
            self._allocator.free(entry.allocation)
            entry.allocation = None
        entry.fail(UnplaceableRequest(error))

    def requeue(self, entries: list[Entry]) -> None:
        """Puts entries that never reached a shard back at the head of the line, in order, without blocks."""
        for entry in entries:
            assert entry.allocation is None, "entries go back to the queue only after their blocks were freed"
            entry.prefilled_len, entry.chunk_len, entry.started_at, entry.requeued = 0, 0, None, entry.requeued + 1
        self._entries.extendleft(reversed(entries))
        QUEUE_SIZE.set(len(self._entries))

    def _take(self, max_size: int | None, prefill_budget: int, token_budget: int) -> list[Entry]:
        taken: list[Entry] = []
        prefill_tokens = total_tokens = 0
        while self._entries and (max_size is None or len(taken) < max_size):
            entry = self._entries[0]
            if entry.cancelled:
                self._entries.popleft()
                continue
            # Checked before allocating: a trial allocation may evict cached prefix blocks for nothing.
            if total_tokens + entry.total_tokens > token_budget:
                break
            # Prompt logprobs need every prompt token computed, so such a request may not reuse a prefix.
            reuse = not entry.request.decoder_input_details
            try:
                request = entry.request
                images = [(i.start, i.digest) for i in request.images]
                allocation = self._allocator.allocate(
                    entry.total_tokens, request.input_ids, reuse, request.adapter_id or "", images
                )
            except Exception as error:  # left at the head it would fail every later step: it leaves the line
                self._entries.popleft()
                self._reject(entry, error)
                continue
            if allocation is None:
                break
            # Shared-prefix tokens are not computed again, so they do not count against the prefill budget.
            prompt = entry.request.input_length - allocation.cache_len
            room = prefill_budget - prefill_tokens
            if prompt > room and not (self._chunked and room > 0):
                self._allocator.free(allocation)
                break
            entry.prefilled_len = allocation.cache_len
            chunk = entry.next_chunk(room) if self._chunked else prompt
            if chunk > room and taken:  # only a step's first chunk may pass the budget (to hold a whole image)
                entry.prefilled_len = 0
                self._allocator.free(allocation)
                break
            self._entries.popleft()
            entry.allocation = allocation
            # Chunked: every entry says its chunk explicitly; the one that does not finish its prompt ends the batch.
            entry.chunk_len = chunk if self._chunked else 0
            taken.append(entry)
            prefill_tokens, total_tokens = prefill_tokens + chunk, total_tokens + entry.total_tokens
            if chunk < prompt:
                break
        return taken

    def _put_back(self, entries: list[Entry]) -> None:
        for entry in entries:
            assert entry.allocation is not None
            self._allocator.free(entry.allocation)
            entry.allocation, entry.prefilled_len, entry.chunk_len = None, 0, 0
        self._entries.extendleft(reversed(entries))
        QUEUE_SIZE.set(len(self._entries))
