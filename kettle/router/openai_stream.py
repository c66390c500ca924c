"""The OpenAI streams (docs/api.md, OpenAI routes): chat chunks and completion events over one or several generations.

Framing, `[DONE]` and the permit release are streaming.py's; this module only produces the payloads. Errors in a
stream travel as OpenAI's `{"error": {"message", "http_status_code"}}` event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from kettle.router.errors import describe
from kettle.router.generation import Collected, GenerationService, record_failure, record_success
from kettle.router.openai_mapping import completion_logprobs, finish_reason, token_logprobs, usage
from kettle.router.openai_schemas import (
    ChatCompletionChunk,
    ChunkChoice,
    Completion,
    CompletionChoice,
    Delta,
)
from kettle.router.tool_stream import ToolStream
from kettle.router.types import IncompleteGeneration, TokenEvent, ValidGenerateRequest

_DONE = object()  # marks the end of one generation in `merged`


@dataclass(frozen=True)
class Meta:
    """What every answer and chunk of one request repeats."""

    id: str
    created: int
    model: str
    system_fingerprint: str

    def fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in ("id", "created", "model", "system_fingerprint")}


def openai_error_event(exc: BaseException) -> dict[str, Any]:
    """OpenAI's in-stream error: the message and the status the error would have had as a JSON answer."""
    status, body = describe(exc)
    return {"error": {"message": body["error"], "http_status_code": status}}


async def token_events(
    service: GenerationService, valid: ValidGenerateRequest, collected: Collected
) -> AsyncIterator[TokenEvent]:
    """The token events of one generation, gathered into `collected`; records the metrics of the outcome."""
    try:
        async with aclosing(service.infer.generate(valid)) as events:
            async for event in events:
                collected.add(event)
                if isinstance(event, TokenEvent):
                    yield event
                if collected.finished:
                    record_success(valid, collected)
                    return
        raise IncompleteGeneration()
    except Exception as exc:
        record_failure(exc)
        raise


async def chat_chunks(
    service: GenerationService,
    valid: ValidGenerateRequest,
    meta: Meta,
    include_usage: bool,
    logprobs: bool,
    tools: bool = False,
) -> AsyncIterator[ChatCompletionChunk]:
    """The role first, then one content delta per token; the last token's chunk has the finish reason.

    With tools, the deltas come from `ToolStream` (name, then argument text); tokens that add nothing to send
    produce no chunk, except the last one, which carries the finish reason."""
    yield ChatCompletionChunk(**meta.fields(), choices=[ChunkChoice(index=0, delta=Delta(content=""))])
    collected, tool_stream = Collected(valid), ToolStream() if tools else None
    async with aclosing(token_events(service, valid, collected)) as events:
        async for event in events:
            # Special tokens (EOS) end the answer; their text is not part of it.
            text = "" if event.token.special else event.token.text
            delta = Delta(content=text) if tool_stream is None else tool_stream.feed(text)
            if delta is None and event.end is None:
                continue
            choice = ChunkChoice(index=0, delta=delta or Delta())
            if logprobs:
                choice.logprobs = token_logprobs([event.token], [event.top_tokens])
            if event.end is not None:
                choice.finish_reason = finish_reason(event.end.finish_reason)
                if tool_stream is not None and tool_stream.called():
                    choice.finish_reason = "tool_calls"
            yield ChatCompletionChunk(**meta.fields(), choices=[choice])
    if include_usage:
        yield ChatCompletionChunk(**meta.fields(), choices=[], usage=usage([collected]))


async def completion_events(
    service: GenerationService,
    valids: Sequence[ValidGenerateRequest],
    meta: Meta,
    include_usage: bool,
    logprobs: bool = False,
) -> AsyncIterator[Completion]:
    """One event per token of any prompt, as they come; `index` tells the prompts apart."""
    collected = [Collected(valid) for valid in valids]
    streams = [_indexed(i, token_events(service, v, c)) for i, (v, c) in enumerate(zip(valids, collected, strict=True))]
    offsets = [0] * len(valids)  # characters sent so far per prompt, for `text_offset`
    async with aclosing(merged(streams)) as events:
        async for index, event in events:
            text = "" if event.token.special else event.token.text
            reason = finish_reason(event.end.finish_reason) if event.end is not None else None
            choice = CompletionChoice(index=index, text=text, finish_reason=reason)
            if logprobs:
                choice.logprobs = completion_logprobs([event.token], [event.top_tokens], offsets[index])
            offsets[index] += len(text)
            yield Completion(**meta.fields(), choices=[choice])
    if include_usage:
        yield Completion(**meta.fields(), choices=[], usage=usage(collected))


async def _indexed(index: int, events: AsyncIterator[TokenEvent]) -> AsyncIterator[tuple[int, TokenEvent]]:
    async with aclosing(events):
        async for event in events:
            yield index, event


async def merged(streams: Sequence[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """The items of all `streams` in arrival order; the first failure fails the whole, and ending early (the
    client left) cancels every stream still running."""
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(stream: AsyncIterator[Any]) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    await queue.put(item)
            await queue.put(_DONE)
        except Exception as exc:
            await queue.put(exc)

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
