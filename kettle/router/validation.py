"""Request validation (docs/api.md, Validation): the rules in exactly their documented order, with TGI's exact messages.

Each rule raises `ValidationError(text)`; the error handler prefixes "Input validation error: ". A request that
breaks several rules gets the message of the first one, so clients see the same text as with TGI.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kettle.proto import generate_pb2
from kettle.router.config import RouterConfig
from kettle.router.errors import ValidationError
from kettle.router.grammar import check_grammar
from kettle.router.images.prompt import ImagePrompt, ImageReader
from kettle.router.images.sources import MARKDOWN_IMAGE, ImageRef
from kettle.router.schemas import GenerateParameters, GenerateRequest, Grammar
from kettle.router.tokenizer import LONG_TEXT_CHARS, TokenizerPool
from kettle.router.types import SamplingParameters, StoppingParameters, ValidGenerateRequest

__all__ = ["Validation", "ValidationError", "ValidationLimits", "is_sampling"]


@dataclass(frozen=True)
class ValidationLimits:
    """The limits validation enforces; the token limits are the ones chosen at warmup."""

    max_best_of: int
    max_stop_sequences: int
    max_top_n_tokens: int
    max_input_tokens: int
    max_total_tokens: int

    @classmethod
    def from_config(cls, config: RouterConfig, max_input_tokens: int, max_total_tokens: int) -> ValidationLimits:
        return cls(
            max_best_of=config.max_best_of,
            max_stop_sequences=config.max_stop_sequences,
            max_top_n_tokens=config.max_top_n_tokens,
            max_input_tokens=max_input_tokens,
            max_total_tokens=max_total_tokens,
        )


def is_sampling(request: GenerateRequest) -> bool:
    """Whether the request samples: do_sample, or any parameter that only means something when sampling."""
    p = request.parameters
    if p is None:
        return True  # TGI's quirk: a request without a `parameters` object samples.
    return (
        p.do_sample
        or (p.temperature is not None and p.temperature != 1.0)
        or p.top_k is not None
        or (p.top_p is not None and p.top_p < 1.0)
        or (p.typical_p is not None and p.typical_p < 1.0)
    )


class Validation:
    """Checks generate requests and turns them into `ValidGenerateRequest`s (tokenized, defaults filled)."""

    def __init__(
        self,
        limits: ValidationLimits,
        tokenizers: TokenizerPool,
        *,
        grammar_support: bool = True,
        images: ImageReader | None = None,
    ) -> None:
        self.limits = limits
        self.tokenizers = tokenizers
        self.grammar_support = grammar_support
        self.images = images  # None: the model takes no images (Markdown images in `inputs` stay text)

    async def validate(
        self,
        request: GenerateRequest,
        *,
        stream: bool = False,
        add_special_tokens: bool = True,
        images: Sequence[ImageRef] | None = None,
    ) -> ValidGenerateRequest:
        """Applies the validation rules in order; `stream` adds the streaming-only rules (16). Chat prompts whose
        template already wrote the BOS token pass `add_special_tokens=False`, so it is not doubled. A chat
        prompt's `images` are the image parts its template wrote a marker for; a `/generate` prompt's images are
        its Markdown images."""
        p = request.parameters or GenerateParameters()
        sampling = is_sampling(request)
        best_of = self._check_best_of(p.best_of, sampling)
        self._check_sampling_ranges(p)
        self._check_counts(p, best_of)
        self._check_inputs(request.inputs, p.truncate)
        grammar, grammar_type = self._grammar(p.grammar)
        await check_grammar(grammar, grammar_type)  # compiled off the event loop; cached
        prompt = await self._image_prompt(request.inputs, images)
        inputs = request.inputs if prompt is None else prompt.text
        if p.truncate is None and len(inputs) > LONG_TEXT_CHARS:
            self._check_fewest_tokens(inputs, p.max_new_tokens)
        encoded = await self.tokenizers.encode(inputs, p.truncate, add_special_tokens)
        located = () if prompt is None or self.images is None else self.images.locate(encoded.ids, prompt.images)
        max_new_tokens = self._check_lengths(len(encoded.ids), p.max_new_tokens)
        if stream:
            _check_streamable(best_of, p.decoder_input_details)
        return ValidGenerateRequest(
            inputs=encoded.text,
            input_ids=encoded.ids,
            truncate=p.truncate,
            decoder_input_details=p.decoder_input_details,
            top_n_tokens=p.top_n_tokens or 0,
            parameters=_sampling_parameters(p, sampling, grammar, grammar_type),
            stopping=StoppingParameters(max_new_tokens=max_new_tokens, stop_sequences=tuple(p.stop)),
            adapter_id=p.adapter_id or None,
            images=located,
        )

    async def _image_prompt(self, inputs: str, chat: Sequence[ImageRef] | None) -> ImagePrompt | None:
        """The prompt with its images read and expanded into image tokens; None when it has none (or the model
        takes none)."""
        if self.images is None:
            if chat:
                raise ValidationError("this model does not take images")
            return None
        if chat is not None:
            return await self.images.chat(inputs, chat) if chat else None
        return await self.images.markdown(inputs) if MARKDOWN_IMAGE.search(inputs) else None

    def _check_best_of(self, best_of: int | None, sampling: bool) -> int:
        """Rule 1."""
        n = 1 if best_of is None else best_of
        if self.limits.max_best_of == 1 and n != 1:
            raise ValidationError("`best_of` != 1 is not allowed for this endpoint")
        if not 0 < n <= self.limits.max_best_of:
            raise ValidationError(f"`best_of` must be > 0 and <= {self.limits.max_best_of}. Given: {n}")
        if n > 1 and not sampling:
            raise ValidationError("you must use sampling when `best_of` is > 1")
        return n

    @staticmethod
    def _check_sampling_ranges(p: GenerateParameters) -> None:
        """Rules 2 to 8."""
        if p.temperature is not None and not p.temperature > 0:  # `not >` also rejects NaN
            raise ValidationError("`temperature` must be strictly positive")
        if p.repetition_penalty is not None and not p.repetition_penalty > 0:
            raise ValidationError("`repetition_penalty` must be strictly positive")
        _check_float32("temperature", p.temperature)
        _check_float32("repetition_penalty", p.repetition_penalty)
        if p.frequency_penalty is not None and not -2.0 <= p.frequency_penalty <= 2.0:
            raise ValidationError("`frequency_penalty` must be >= -2.0 and <= 2.0")
        if p.presence_penalty is not None and not -2.0 <= p.presence_penalty <= 2.0:
            raise ValidationError("`presence_penalty` must be >= -2.0 and <= 2.0")
        if p.top_p is not None and not 0.0 < p.top_p < 1.0:
            raise ValidationError("`top_p` must be > 0.0 and < 1.0")
        if p.typical_p is not None and not 0.0 < p.typical_p < 1.0:
            raise ValidationError("`typical_p` must be > 0.0 and < 1.0")
        if p.top_k is not None and p.top_k <= 0:
            raise ValidationError("`top_k` must be strictly positive")
        if p.max_new_tokens is not None and p.max_new_tokens <= 0:
            raise ValidationError("`max_new_tokens` must be strictly positive")

    def _check_counts(self, p: GenerateParameters, best_of: int) -> None:
        """Rules 9 to 11."""
        if len(p.stop) > self.limits.max_stop_sequences:
            raise ValidationError(
                f"`stop` supports up to {self.limits.max_stop_sequences} stop sequences. Given: {len(p.stop)}"
            )
        if best_of > 1 and p.seed is not None:
            raise ValidationError("`seed` must not be set when `best_of` > 1")
        top_n = p.top_n_tokens or 0
        if not 0 <= top_n <= self.limits.max_top_n_tokens:
            raise ValidationError(f"`top_n_tokens` must be >= 0 and <= {self.limits.max_top_n_tokens}. Given: {top_n}")

    def _check_inputs(self, inputs: str, truncate: int | None) -> None:
        """Rules 12 and 13."""
        if not inputs:
            raise ValidationError("`inputs` cannot be empty")
        if truncate is not None and not 0 < truncate <= self.limits.max_input_tokens:
            raise ValidationError(
                f"`truncate` must be strictly positive and less than {self.limits.max_input_tokens}. Given: {truncate}"
            )

    def _check_fewest_tokens(self, inputs: str, max_new_tokens: int | None) -> None:
        """Rules 14 and 15 on the fewest tokens a long `inputs` can have (char_bound.py), before tokenizing: a prompt
        over the limits by its length alone is refused without the tokenizer's time and memory. The count is a
        lower bound, so the message says "at least"; shorter prompts, and long ones within the bound, are tokenized
        and get TGI's exact count. Not under `truncate`: the prompt is cut to its last tokens, whatever its length."""
        fewest = self.tokenizers.bound.fewest_tokens(inputs)
        if fewest:  # 0: the tokenizer has no bound
            self._check_lengths(fewest, max_new_tokens, given="at least ")

    def _check_lengths(self, input_length: int, max_new_tokens: int | None, given: str = "") -> int:
        """Rules 14 and 15; returns max_new_tokens, defaulting to what is left of max_total_tokens."""
        total = self.limits.max_total_tokens
        if max_new_tokens is None:
            max_new_tokens = max(total - input_length, 0)
        if input_length + max_new_tokens > total:
            raise ValidationError(
                f"`inputs` tokens + `max_new_tokens` must be <= {total}. "
                f"Given: {given}{input_length} `inputs` tokens and {max_new_tokens} `max_new_tokens`"
            )
        if input_length > self.limits.max_input_tokens:
            raise ValidationError(
                f"`inputs` must have less than {self.limits.max_input_tokens} tokens. Given: {given}{input_length}"
            )
        return max_new_tokens

    def _grammar(self, grammar: Grammar | None) -> tuple[str, int]:
        """The grammar as the shard receives it: (text, proto GrammarType). Checked after rule 13, as TGI does."""
        if grammar is None:
            return "", generate_pb2.GRAMMAR_TYPE_NONE
        if not self.grammar_support:
            raise ValidationError("grammar is not supported")
        if grammar.type == "regex":
            if not isinstance(grammar.value, str):
                raise ValidationError("grammar of type `regex` needs a string value")
            return grammar.value, generate_pb2.GRAMMAR_TYPE_REGEX
        return _json_schema_text(grammar), generate_pb2.GRAMMAR_TYPE_JSON


# The shards compute in float32: a positive value beyond these ends is infinite or 0 there, and would turn
# the row's probabilities into NaN (Infinity and 1e400 parse as floats in JSON).
_FLOAT32_MAX = 3.4028234e38
_FLOAT32_TINY = 1.1754944e-38


def _check_float32(name: str, value: float | None) -> None:
    if value is not None and not _FLOAT32_TINY <= value <= _FLOAT32_MAX:
        raise ValidationError(f"`{name}` must be finite and representable as a float32. Given: {value}")


def _sampling_parameters(p: GenerateParameters, sampling: bool, grammar: str, grammar_type: int) -> SamplingParameters:
    """Defaults filled in; an absent seed becomes a random uint64."""
    return SamplingParameters(
        temperature=1.0 if p.temperature is None else p.temperature,
        top_k=p.top_k or 0,
        top_p=1.0 if p.top_p is None else p.top_p,
        typical_p=1.0 if p.typical_p is None else p.typical_p,
        do_sample=sampling,
        seed=random.getrandbits(64) if p.seed is None else p.seed,
        repetition_penalty=1.0 if p.repetition_penalty is None else p.repetition_penalty,
        frequency_penalty=p.frequency_penalty or 0.0,
        presence_penalty=p.presence_penalty or 0.0,
        watermark=p.watermark,
        grammar=grammar,
        grammar_type=grammar_type,
    )


def _json_schema_text(grammar: Grammar) -> str:
    value: Any = grammar.value
    if grammar.type == "json_schema":
        if not isinstance(value, dict) or "schema" not in value:
            raise ValidationError("grammar of type `json_schema` needs a value with a `schema` field")
        value = value["schema"]
    if isinstance(value, str):
        return value
    if not isinstance(value, dict):
        raise ValidationError(f"grammar of type `{grammar.type}` needs a JSON Schema object")
    return json.dumps(value)


def _check_streamable(best_of: int, decoder_input_details: bool) -> None:
    """Rule 16 (streaming only)."""
    if best_of != 1:
        raise ValidationError("`best_of` != 1 is not supported when streaming tokens")
    if decoder_input_details:
        raise ValidationError("`decoder_input_details` == true is not supported when streaming tokens")
