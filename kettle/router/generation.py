"""The request path shared by every generation route (TGI's now, OpenAI's later), independent of answer shapes.

Count the request, take a concurrency permit *before* validating (none free → 429), validate, run one or
`best_of` candidates through `Infer.generate`, record the request metrics. Route modules give the permit back when
their answer (or stream) ends and turn `Collected` results into their own JSON.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar

from fastapi import Request

from kettle import tracing
from kettle.router import metrics, request_log
from kettle.router.adapters import check_adapter
from kettle.router.errors import ApiError, Overloaded
from kettle.router.images.sources import ImageRef
from kettle.router.schemas import GenerateRequest
from kettle.router.types import IncompleteGeneration, InferEvent, PrefillEvent, Token, TokenEvent, ValidGenerateRequest
from kettle.router.validation import Validation

T = TypeVar("T")


class InferLike(Protocol):
    """The part of `Infer` the routes use."""

    def generate(self, request: ValidGenerateRequest) -> AsyncIterator[InferEvent]: ...


class ClientClosed(ApiError):
    """The client went away before its answer was ready (nginx's 499); nobody reads this answer."""

    status = 499
    error_type = "client_closed"


class Permits:
    """`--max-concurrent-requests` permits, taken without waiting: none free means 429 `overloaded`."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.available = total

    def acquire(self) -> None:
        # One event-loop thread: a plain counter is an asyncio semaphore that is never waited on.
        if self.available == 0:
            raise Overloaded()
        self.available -= 1

    def release(self) -> None:
        self.available += 1


@dataclass
class Collected:
    """Every event of one finished generation; `last` is the final token's event (it carries the end)."""

    request: ValidGenerateRequest
    prefill: tuple[Token, ...] = ()
    tokens: list[Token] = field(default_factory=list)
    top_tokens: list[tuple[Token, ...]] = field(default_factory=list)
    last: TokenEvent | None = None
    first_token_at: float | None = None  # monotonic, when the first token reached the router

    def add(self, event: InferEvent) -> None:
        if isinstance(event, PrefillEvent):
            self.prefill = event.tokens
            return
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.tokens.append(event.token)
        self.top_tokens.append(event.top_tokens)
        self.last = event

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.end is not None

    @property
    def mean_logprob(self) -> float:
        logprobs = [t.logprob for t in self.tokens if t.logprob is not None and math.isfinite(t.logprob)]
        return sum(logprobs) / len(logprobs) if logprobs else -math.inf


@dataclass(frozen=True)
class Times:
    """Durations (s) of a finished request, from the monotonic stamps on its last event."""

    total: float
    queue: float
    inference: float
    per_token: float

    @classmethod
    def of(cls, valid: ValidGenerateRequest, last: TokenEvent, generated_tokens: int) -> Times:
        now = time.monotonic()
        queued = last.queued_at if last.queued_at is not None else valid.received_at + valid.validation_time
        started = last.started_at if last.started_at is not None else queued
        inference = now - started
        return cls(now - valid.received_at, max(started - queued, 0.0), inference, inference / max(generated_tokens, 1))


class GenerationService:
    """Admission, validation and execution of generation requests (see the module docstring)."""

    def __init__(
        self,
        infer: InferLike,
        validation: Validation,
        permits: Permits,
        compute_type: str,
        adapters: tuple[str, ...] = (),
    ) -> None:
        self.infer = infer
        self.validation = validation
        self.permits = permits
        self.compute_type = compute_type
        self.adapters = adapters  # the LoRA adapters a request may name in `adapter_id`

    async def admit(
        self,
        body: GenerateRequest,
        *,
        stream: bool,
        add_special_tokens: bool = True,
        images: Sequence[ImageRef] | None = None,
    ) -> ValidGenerateRequest:
        """Counts the request, takes a permit, validates. On failure the permit is back and the failure counted."""
        received = time.monotonic()
        metrics.REQUEST_COUNT.inc()
        try:
            self.permits.acquire()
        except Overloaded as exc:
            record_failure(exc)
            raise
        try:
            with tracing.span("validation"):  # a no-op unless tracing is on
                check_adapter(body.parameters, self.adapters)
                valid = await self.validation.validate(
                    body, stream=stream, add_special_tokens=add_special_tokens, images=images
                )
        except BaseException as exc:
            self.permits.release()
            record_failure(exc)
            raise
        if valid.adapter_id:
            metrics.LORA_REQUESTS.labels(adapter=valid.adapter_id).inc()
            tracing.annotate(adapter_id=valid.adapter_id)
        return replace(valid, received_at=received, validation_time=time.monotonic() - received)

    async def run(self, valid: ValidGenerateRequest, best_of: int = 1) -> list[Collected]:
        """Runs `best_of` candidates concurrently, each with its own seed; the best (highest mean logprob) first."""
        requests = [valid] + [_reseeded(valid) for _ in range(best_of - 1)]
        tasks = [asyncio.ensure_future(collect(self.infer.generate(r), r)) for r in requests]
        try:
            results = await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # a failed candidate (or a cancelled request) must not leave the others running
                task.cancel()
        best = max(range(len(results)), key=lambda i: results[i].mean_logprob)
        return [results[best]] + [r for i, r in enumerate(results) if i != best]

    async def run_for(self, request: Request, valid: ValidGenerateRequest, best_of: int = 1) -> list[Collected]:
        """`run`, cancelled if the HTTP client disconnects first; records the outcome in the metrics."""
        try:
            results = await until_disconnect(request, self.run(valid, best_of))
        except BaseException as exc:
            record_failure(exc)
            raise
        record_success(valid, results[0])
        return results


async def collect(events: AsyncIterator[InferEvent], request: ValidGenerateRequest) -> Collected:
    """Drains one generation; a stream that ends without its final token is an `IncompleteGeneration`."""
    collected = Collected(request)
    async with aclosing(events):
        async for event in events:
            collected.add(event)
            if collected.finished:
                return collected
    raise IncompleteGeneration()


def _reseeded(valid: ValidGenerateRequest) -> ValidGenerateRequest:
    return replace(valid, parameters=replace(valid.parameters, seed=random.getrandbits(64)))


def record_success(valid: ValidGenerateRequest, result: Collected) -> None:
    """The request metrics of a finished generation (TGI's names)."""
    assert result.last is not None and result.last.end is not None
    generated = result.last.end.generated_tokens
    times = Times.of(valid, result.last, generated)
    metrics.REQUEST_SUCCESS.inc()
    metrics.REQUEST_DURATION.observe(times.total)
    metrics.REQUEST_VALIDATION_DURATION.observe(valid.validation_time)
    metrics.REQUEST_QUEUE_DURATION.observe(times.queue)
    if result.first_token_at is not None:
        metrics.REQUEST_FIRST_TOKEN_DURATION.observe(result.first_token_at - valid.received_at)
    metrics.REQUEST_INFERENCE_DURATION.observe(times.inference)
    metrics.REQUEST_MEAN_TIME_PER_TOKEN.observe(times.per_token)
    metrics.REQUEST_INPUT_LENGTH.observe(valid.input_length)
    metrics.REQUEST_GENERATED_TOKENS.observe(generated)
    durations = {"total": times.total, "validation": valid.validation_time, "queue": times.queue}
    durations |= {"inference": times.inference, "per_token": times.per_token}
    reason = str(result.last.end.finish_reason)
    request_log.success(valid.input_length, generated, reason, durations, valid.adapter_id)


def record_failure(exc: BaseException) -> None:
    """Counts a failure by error type; cancellations and vanished clients are not failures of the server."""
    if isinstance(exc, Exception) and not isinstance(exc, ClientClosed):
        error_type = getattr(exc, "error_type", "incomplete_generation")
        metrics.REQUEST_FAILURE.labels(err=error_type).inc()
        request_log.failure(error_type, str(exc) or type(exc).__name__)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, cancelling it if the client disconnects first: no point generating for nobody."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()  # a no-op once finished
    if task in done:
        return task.result()
    raise ClientClosed("Client closed the connection")


async def _disconnected(request: Request) -> None:
    # The body is already read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
