"""Typed messages between the router's stages: validation → queue/scheduler → route handlers.

Validation produces a `ValidGenerateRequest`; `Infer.generate` consumes it and yields `InferEvent`s
(`PrefillEvent`, then one `TokenEvent` per token, the last one with `end` set). Nothing here holds tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum


class FinishReason(StrEnum):
    """Why a generation ended (the strings are TGI's)."""

    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"


@dataclass(frozen=True)
class SamplingParameters:
    """What the shard needs to choose the next token (mirrors proto `NextTokenChooserParameters`)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    do_sample: bool = False
    seed: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    watermark: bool = False
    grammar: str = ""
    grammar_type: int = 0  # proto GrammarType
    presence_penalty: float = 0.0  # OpenAI's; only the OpenAI routes set it


@dataclass(frozen=True)
class StoppingParameters:
    """When the shard stops a request (mirrors proto `StoppingCriteriaParameters`)."""

    max_new_tokens: int
    stop_sequences: tuple[str, ...] = ()
    ignore_eos_token: bool = False


@dataclass(frozen=True)
class PromptImage:
    """One image of a validated prompt: its bytes and digest, and its run of image tokens in `input_ids`."""

    data: bytes
    digest: bytes
    start: int
    length: int
    # Its tokens attend to each other both ways (Gemma 3): a prefill chunk holds all of them (chunk_spans.py).
    whole: bool = False


@dataclass(frozen=True)
class ValidGenerateRequest:
    """A request that passed validation: tokenized, truncated, every default filled in."""

    inputs: str  # prompt text after truncation
    input_ids: tuple[int, ...]
    truncate: int | None
    decoder_input_details: bool
    top_n_tokens: int
    parameters: SamplingParameters
    stopping: StoppingParameters
    adapter_id: str | None = None  # the LoRA adapter it runs with; None: the base model
    images: tuple[PromptImage, ...] = ()  # a prompt's images and their runs of image tokens in input_ids
    # Filled by the route handler for headers, logs and metrics.
    validation_time: float = 0.0
    received_at: float = field(default_factory=time.monotonic)

    @property
    def input_length(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class Token:
    """One token as the API reports it."""

    id: int
    text: str
    logprob: float | None
    special: bool


@dataclass(frozen=True)
class GeneratedText:
    """The final text of a request, sent with its last token."""

    text: str
    generated_tokens: int
    finish_reason: FinishReason
    seed: int | None


@dataclass(frozen=True)
class PrefillEvent:
    """The prompt tokens with their logprobs (first logprob None); only with decoder_input_details."""

    tokens: tuple[Token, ...]


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. `end` is set on the request's last token."""

    token: Token
    top_tokens: tuple[Token, ...]
    end: GeneratedText | None = None
    # Set on the last event: monotonic times for the response headers and metrics.
    queued_at: float | None = None
    started_at: float | None = None


InferEvent = PrefillEvent | TokenEvent


class InferError(Exception):
    """Base of the errors `Infer.generate` raises; `error_type` and `status` map to docs/api.md, Errors."""

    status = 500
    error_type = "incomplete_generation"


class GenerationError(InferError):
    """A shard failed during generation (424)."""

    status = 424
    error_type = "generation"

    def __init__(self, cause: str) -> None:
        super().__init__(f"Request failed during generation: {cause}")


class IncompleteGeneration(InferError):
    """The generation ended without a final token (500)."""

    def __init__(self) -> None:
        super().__init__("Incomplete generation")


SHUTTING_DOWN = "Server is shutting down"


class ShuttingDown(InferError):
    """The drain's deadline passed before the request finished (503, like the refusals while draining)."""

    status = 503
    error_type = "unavailable"

    def __init__(self) -> None:
        super().__init__(f"{SHUTTING_DOWN}: the request did not finish within the graceful termination timeout")
