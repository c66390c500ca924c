"""What the scheduler sends down a request's channel for one shard `Generation`: prompt tokens, then tokens."""

from __future__ import annotations

import math

from kettle.proto import generate_pb2 as pb
from kettle.router.queue import Entry
from kettle.router.types import FinishReason, GeneratedText, InferEvent, PrefillEvent, Token, TokenEvent

_FINISH_REASONS = {
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_EOS_TOKEN: FinishReason.EOS_TOKEN,
    pb.FINISH_REASON_STOP_SEQUENCE: FinishReason.STOP_SEQUENCE,
}


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
