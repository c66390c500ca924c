"""OpenAI requests as TGI generate requests, and TGI results as OpenAI fields (docs/api.md, OpenAI routes).

The OpenAI routes do not validate on their own: they turn the body into a `GenerateRequest` and let the shared
validation check it, so a bad `temperature` gets the same message as on /generate. Only what TGI's parameters
cannot express is refused here, with a 422 that says it is not supported.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from typing import Any, Literal

from kettle.router.chat_template import ChatTemplate
from kettle.router.errors import ApiError, TemplateError, ValidationError
from kettle.router.generation import Collected
from kettle.router.grammar import response_format_grammar
from kettle.router.images.sources import ImageRef, chat_images
from kettle.router.openai_schemas import (
    ChatMessage,
    ChatRequest,
    ChoiceLogprobs,
    CompletionLogprobs,
    CompletionRequest,
    ContentPart,
    SamplingFields,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from kettle.router.schemas import GenerateParameters, GenerateRequest, Grammar
from kettle.router.tools import ToolError, ToolPlan, tools_prompt
from kettle.router.types import FinishReason, Token

logger = logging.getLogger(__name__)

OpenAIFinish = Literal["stop", "length"]


class SuffixNotSupported(ApiError):
    """TGI's answer to a completions `suffix`: 422 with its own error type and message."""

    status = 422
    error_type = "suffix not supported"

    def __init__(self) -> None:
        super().__init__("Suffix is not supported and can be achieved by preprocessing the prompt.")


class BatchSizeExceeded(ApiError):
    """TGI's answer to more completions prompts than `--max-client-batch-size`."""

    status = 422
    error_type = "batch size exceeded"

    def __init__(self, limit: int) -> None:
        super().__init__(f"Number of prompts exceeds the maximum allowed batch size of {limit}")


def chat_prompt(
    template: ChatTemplate | None, body: ChatRequest, tools: ToolPlan | None = None, images: bool = False
) -> tuple[str, bool]:
    """The rendered prompt, and whether the tokenizer should still add its special tokens.

    A template that writes the BOS token itself must not get a second one from the tokenizer. Offered tools go
    to the template as `tools` when it renders them, otherwise (as TGI does) after the last message's content.
    With `images` (a model that takes them), content given as parts reaches the template as parts, an image as
    `{"type": "image"}`: the template writes the model's marker for each, in order.
    """
    if template is None:
        raise TemplateError("this model has no chat template")
    messages = []
    for message in body.messages:
        fields = message.model_dump(exclude_none=True)
        if images and isinstance(message.content, list):
            fields["content"] = [_template_part(part) for part in message.content]
        else:
            fields["content"] = message.text() or ""  # templates expect a string, even for tool-call turns
        messages.append(fields)
    extra = {}
    if tools is not None:
        offered = [{"type": "function", "function": f} for f in tools.functions]
        if "tools" in template.source:
            extra["tools"] = offered
        elif messages and isinstance(messages[-1]["content"], list):
            messages[-1]["content"].append({"type": "text", "text": tools_prompt(offered, body.tool_prompt)})
        elif messages:
            messages[-1]["content"] += tools_prompt(offered, body.tool_prompt)
    text = template.render(messages, **extra)
    adds_bos_itself = bool(template.bos_token) and text.startswith(template.bos_token)
    return text, not adds_bos_itself


def _template_part(part: ContentPart) -> dict[str, Any]:
    if part.type == "image_url":
        return {"type": "image"}
    return {"type": "text", "text": part.text or ""}


def chat_image_refs(body: ChatRequest) -> list[ImageRef]:
    """The image parts of a chat body, in the order the template writes their markers."""
    return chat_images(
        [part.model_dump() for part in m.content] if isinstance(m.content, list) else m.content for m in body.messages
    )


def chat_request(body: ChatRequest, prompt: str, tools: ToolPlan | None = None) -> GenerateRequest:
    """The generate request of a chat body (after `check_chat_supported`); tools become a JSON grammar."""
    max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
    parameters = _parameters(body, max_tokens=max_tokens)
    if body.logprobs:
        parameters.top_n_tokens = body.top_logprobs
    parameters.grammar = response_format_grammar(body.response_format)
    if tools is not None:
        parameters.grammar = Grammar(type="json", value=tools.schema)
    return GenerateRequest(inputs=prompt, parameters=parameters)


def completion_request(body: CompletionRequest, prompt: str) -> GenerateRequest:
    """The generate request of one prompt of a completions body (after `check_completion_supported`)."""
    parameters = _parameters(body, max_tokens=body.max_tokens)
    parameters.repetition_penalty = body.repetition_penalty
    parameters.top_n_tokens = body.logprobs
    return GenerateRequest(inputs=prompt, parameters=parameters)


def _parameters(body: SamplingFields, max_tokens: int | None) -> GenerateParameters:
    """TGI's mapping: temperature 0 is greedy, anything else (absent included, OpenAI's default is 1) samples."""
    greedy = body.temperature == 0
    return GenerateParameters(
        do_sample=not greedy,
        temperature=None if greedy else body.temperature,
        # OpenAI's top_p = 1 means "no nucleus cut", which TGI spells as no top_p at all.
        top_p=None if body.top_p == 1.0 else body.top_p,
        max_new_tokens=max_tokens,
        seed=body.seed,
        stop=body.stop_list(),
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
    )


def check_chat_supported(body: ChatRequest, images: bool = False) -> None:
    """422 for chat features not implemented; tools with a response format are TGI's `tool_error`."""
    _check_common(body)
    check_content(body.messages, images)
    if body.functions or body.function_call is not None:
        raise ValidationError("`functions` and `function_call` are not supported: use `tools` and `tool_choice`")
    if body.tools and response_format_grammar(body.response_format) is not None:
        raise ToolError("Grammar and tools are mutually exclusive")


def check_content(messages: Sequence[ChatMessage], images: bool = False) -> None:
    """422 naming the content parts the model cannot read (an image for a text model is refused, not dropped);
    `images`: the model takes `image_url` parts."""
    parts = [part for message in messages if isinstance(message.content, list) for part in message.content]
    served = {"text", "image_url"} if images else {"text"}
    if unserved := sorted({part.type for part in parts if part.type not in served}):
        kinds = ", ".join(f"`{kind}`" for kind in unserved)
        reads = "text and image parts" if images else "text parts"
        raise ValidationError(f"content parts of type {kinds} are not supported: this server reads {reads} only")
    if any(part.text is None for part in parts if part.type == "text"):
        raise ValidationError("a `text` content part needs its `text`")


_noted: set[str] = set()


def note_ignored(extra: dict[str, Any]) -> None:
    """Logs each field outside OpenAI's API (a gateway's, another server's extension) the first time a request
    carries it: ignored, but never unseen."""
    for name in sorted(extra.keys() - _noted):
        _noted.add(name)
        logger.warning("OpenAI request field `%s` is not supported by this server and is ignored", name)


def check_completion_supported(body: CompletionRequest, max_prompts: int) -> list[str]:
    """The prompts of a completions body; 422 for `suffix`, no prompt, or more than `max_prompts`."""
    _check_common(body)
    if body.suffix is not None:
        raise SuffixNotSupported()
    if body.echo:
        raise ValidationError("`echo` is not supported yet")
    if body.logprobs is not None and body.logprobs < 0:
        raise ValidationError(f"`logprobs` must be >= 0. Given: {body.logprobs}")
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if not prompts:
        raise ValidationError("`prompt` cannot be an empty list")
    if len(prompts) > max_prompts:
        raise BatchSizeExceeded(max_prompts)
    return prompts


def _check_common(body: SamplingFields) -> None:
    note_ignored(body.model_extra or {})
    if body.n is not None and body.n != 1:
        raise ValidationError("`n` > 1 is not supported yet")
    if body.logit_bias:
        raise ValidationError("`logit_bias` is not supported yet")
    # 0 is not "unset": OpenAI refuses it, and treating it as absent would generate to the end of the context.
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(body, name, None)
        if value is not None and value <= 0:
            raise ValidationError(f"`{name}` must be strictly positive")


def finish_reason(reason: FinishReason) -> OpenAIFinish:
    """EOS and stop strings are both `stop` for OpenAI."""
    return "length" if reason == FinishReason.LENGTH else "stop"


def usage(results: Sequence[Collected]) -> Usage:
    """Real token counts: validated prompt tokens and generated tokens, summed over the choices."""
    prompt = sum(r.request.input_length for r in results)
    completion = sum(r.last.end.generated_tokens for r in results if r.last and r.last.end)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def token_logprobs(tokens: Sequence[Token], top_tokens: Sequence[Sequence[Token]]) -> ChoiceLogprobs:
    """OpenAI's `logprobs.content`: each generated token with its logprob and the most likely alternatives."""
    content = []
    for token, tops in zip(tokens, top_tokens, strict=True):
        alternatives = [TopLogprob(token=t.text, logprob=_finite(t.logprob)) for t in tops]
        content.append(TokenLogprob(token=token.text, logprob=_finite(token.logprob), top_logprobs=alternatives))
    return ChoiceLogprobs(content=content)


def completion_logprobs(
    tokens: Sequence[Token], top_tokens: Sequence[Sequence[Token]], offset: int = 0
) -> CompletionLogprobs:
    """The legacy `logprobs` of completions; `text_offset` counts characters from `offset` (where the tokens'
    text starts in the choice's text). Special tokens (EOS) have empty text, as in `text`."""
    texts = ["" if t.special else t.text for t in tokens]
    offsets = list(itertools.accumulate((len(x) for x in texts[:-1]), initial=offset)) if texts else []
    return CompletionLogprobs(
        tokens=texts,
        token_logprobs=[_finite(t.logprob) for t in tokens],
        top_logprobs=[{t.text: _finite(t.logprob) for t in tops} for tops in top_tokens],
        text_offset=offsets,
    )


def _finite(logprob: float | None) -> float | None:
    return logprob if logprob is not None and math.isfinite(logprob) else None
