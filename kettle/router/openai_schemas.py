"""Pydantic models of the OpenAI-compatible API (docs/api.md, OpenAI routes): chat and legacy completions, requests and
answers.

Requests are lenient about unknown fields (OpenAI clients send many this server ignores) and treat `null` as
absent. Ranges are not checked here: the request becomes a TGI `GenerateRequest` and validation.py checks it,
so a bad value gets the same message on every route.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kettle.router.schemas import UINT32_MAX, UINT64_MAX, SimpleToken, _OmitsEmpty


class ContentPart(BaseModel):
    """One part of a message's content. Only text parts are served (the models here read text); any other type
    (`image_url`, `input_audio`) is refused by name before the request is queued."""

    model_config = ConfigDict(extra="allow")  # an image part's `image_url`, an audio part's `input_audio`

    type: str = "text"
    text: str | None = None


class ChatMessage(BaseModel):
    """A message of the conversation; extra fields (`name`, `tool_calls`...) reach the template as they are."""

    model_config = ConfigDict(extra="allow")

    role: str = Field(examples=["user"])
    content: str | list[ContentPart] | None = Field(None, examples=["What is Deep Learning?"])

    def text(self) -> str | None:
        """The content as one string: text parts are joined without separators, as OpenAI does."""
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content)
        return self.content


class StreamOptions(BaseModel):
    include_usage: bool = Field(False, description="Send a last chunk with `usage` and no choices.")


class SamplingFields(BaseModel):
    """The fields chat and completions share; every one may be absent. OpenAI's own fields that this server does
    not serve are declared and refused when set (`n`, `logit_bias`, `echo`, `functions`...). Other fields are
    kept in `model_extra` and ignored, each named once in the log (`openai_mapping.note_ignored`): gateways add
    their own at neutral values (vllm-router: `ignore_eos: false`, `skip_special_tokens: true`...), and refusing
    them would refuse every request they forward, as vLLM and TGI do not."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="Ignored: this server runs one model.", examples=["tgi"])
    user: str | None = Field(None, description="Ignored: OpenAI's end-user label for abuse monitoring.")
    max_tokens: int | None = Field(
        None, le=UINT32_MAX, description="Maximum number of generated tokens.", examples=[32]
    )
    temperature: float | None = Field(None, description="0 is greedy; absent or > 0 samples.", examples=[1.0])
    top_p: float | None = Field(None, description="Nucleus sampling mass in (0, 1].", examples=[0.95])
    seed: int | None = Field(None, ge=0, le=UINT64_MAX, description="Random seed for sampling.", examples=[42])
    stop: str | list[str] | None = Field(None, description="Stop when one of these is generated.")
    frequency_penalty: float | None = Field(None, description="Penalty in [-2, 2] by token frequency.")
    presence_penalty: float | None = Field(None, description="Penalty in [-2, 2] for every token already generated.")
    n: int | None = Field(None, le=UINT32_MAX, description="Only 1 is supported.", examples=[1])
    logit_bias: dict[str, float] | None = Field(None, description="Not supported yet.")
    stream: bool = Field(False, description="Answer with server-sent events, ending with `data: [DONE]`.")
    stream_options: StreamOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_absent(cls, data: Any) -> Any:
        # Some clients send every known field, unset ones as null.
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatRequest(SamplingFields):
    """Body of /v1/chat/completions and /chat_tokenize."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, le=UINT32_MAX, description="Alias of `max_tokens`.")
    logprobs: bool | None = Field(None, description="Return the logprob of every generated token.")
    top_logprobs: int | None = Field(None, le=UINT32_MAX, description="Return this many most likely tokens per step.")
    tools: list[dict[str, Any]] | None = Field(None, description="Functions the model may call (OpenAI format).")
    tool_choice: Any = Field(
        None,
        description="`auto` (default with tools), `none`, `required`, a name, or {type: function, function: {name}}.",
    )
    tool_prompt: str | None = Field(None, description="Text after the tools when the template does not render them.")
    functions: list[dict[str, Any]] | None = Field(None, description="OpenAI's deprecated form of `tools`: refused.")
    function_call: Any = Field(None, description="OpenAI's deprecated form of `tool_choice`: refused.")
    response_format: dict[str, Any] | None = Field(
        None, description="`text`, `json_object`, `json_schema` (OpenAI or TGI spelling) or {type: regex, value}."
    )


class CompletionRequest(SamplingFields):
    """Body of /v1/completions."""

    prompt: str | list[str] = Field(examples=["The capital of France is"])
    logprobs: int | None = Field(
        None, le=UINT32_MAX, description="Return the logprobs of this many most likely tokens per step."
    )
    repetition_penalty: float | None = Field(None, description="Penalty > 0 for repeated tokens.")
    suffix: str | None = Field(None, description="Not supported.")
    echo: bool | None = Field(None, description="Only false is supported (the prompt is not repeated).")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float | None


class TokenLogprob(BaseModel):
    token: str
    logprob: float | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str | None = None
    arguments: str


class ToolCall(BaseModel):
    """One call of a function; in a stream, the first delta carries id, type and name, the next ones only
    argument text."""

    index: int = 0
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall


class AssistantMessage(_OmitsEmpty):
    omit_when_empty: ClassVar[tuple[str, ...]] = ("tool_calls",)

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class _Answer(BaseModel):
    id: str
    created: int = Field(description="Unix time (s).")
    model: str
    system_fingerprint: str


class ChatCompletion(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class Delta(_OmitsEmpty):
    omit_when_empty: ClassVar[tuple[str, ...]] = ("tool_calls",)

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(_Answer):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs: parallel lists over the generated tokens."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class Completion(_Answer):
    """A completions answer, and also one event of a completions stream (`finish_reason` then on the last)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class Model(_OmitsEmpty):
    omit_when_empty: ClassVar[tuple[str, ...]] = ("input_modalities",)

    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str
    input_modalities: list[str] = Field(
        default_factory=list, description='["text", "image"] for a model that takes images; absent for text only.'
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class ChatTokenizeResponse(BaseModel):
    """Answer of /chat_tokenize: the rendered prompt and its tokens with byte offsets."""

    tokenize_response: list[SimpleToken]
    templated_text: str
