"""Pydantic models of TGI's generate API (docs/api.md, Generate parameters; Responses and streams): request parsing,
responses, and /docs.

Only JSON types are checked here. The ranges (docs/api.md, Validation) are validation.py's job, so that a bad value gets
TGI's exact message instead of pydantic's. Models are strict (no "20" for an int), like TGI's serde.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from kettle.router.types import FinishReason

UINT64_MAX = 2**64 - 1
# The shards' protocol carries these counts as uint32: a larger value is refused here, naming the field, instead
# of failing the batch it would have joined.
UINT32_MAX = 2**32 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True)


class _OmitsEmpty(BaseModel):
    """Drops the fields named in `omit_when_empty` from the JSON when they are None or empty (TGI's serde skips)."""

    omit_when_empty: ClassVar[tuple[str, ...]] = ()

    # No return annotation on purpose: pydantic then documents the model's own fields, not a bare dict.
    @model_serializer(mode="wrap")
    def _skip_empty(self, handler):
        data = handler(self)
        for name in self.omit_when_empty:
            if data.get(name) in (None, []):
                data.pop(name, None)
        return data


class Grammar(_Strict):
    """A constraint on the output (docs/api.md, Structured output and tools)."""

    type: Literal["json", "json_object", "regex", "json_schema"] = Field(description="Kind of grammar.")
    value: Any = Field(
        description="A JSON Schema (json, json_object), a regular expression (regex) or {name?, schema} (json_schema).",
        examples=[{"type": "object", "properties": {"name": {"type": "string"}}}],
    )


class GenerateParameters(_Strict):
    """Generation parameters; every one may be absent (docs/api.md, Generate parameters). A parameter this server
    does not know is a 422 naming it, not ignored as TGI does: a misspelt one (`max_tokens` here) would otherwise
    change the answer without a word."""

    model_config = ConfigDict(strict=True, extra="forbid")

    best_of: int | None = Field(
        None, le=UINT32_MAX, description="Generate this many sampled sequences, return the best.", examples=[1]
    )
    decoder_input_details: bool = Field(False, description="Return the prompt tokens with their logprobs.")
    details: bool = Field(False, description="Return tokens, logprobs and the finish reason.", examples=[True])
    do_sample: bool = Field(False, description="Sample instead of choosing the most likely token.")
    frequency_penalty: float | None = Field(None, description="Penalty in [-2, 2] by token frequency.", examples=[0.1])
    grammar: Grammar | None = Field(None, description="Constrain the output to a grammar.")
    presence_penalty: float | None = Field(
        None, description="OpenAI's presence penalty in [-2, 2]: subtracted once per token already generated."
    )
    max_new_tokens: int | None = Field(
        None, le=UINT32_MAX, description="Maximum number of generated tokens.", examples=[20]
    )
    repetition_penalty: float | None = Field(None, description="Penalty > 0 for repeated tokens.", examples=[1.03])
    return_full_text: bool | None = Field(None, description="Prepend the prompt to the generated text.")
    seed: int | None = Field(None, ge=0, le=UINT64_MAX, description="Random seed for sampling.", examples=[None])
    stop: list[str] = Field(default_factory=list, description="Stop when one of these is generated.")
    temperature: float | None = Field(None, description="Temperature > 0 of the sampling.", examples=[0.5])
    top_k: int | None = Field(None, le=UINT32_MAX, description="Keep the k most likely tokens.", examples=[10])
    top_n_tokens: int | None = Field(
        None, le=UINT32_MAX, description="Return this many most likely tokens per step.", examples=[5]
    )
    top_p: float | None = Field(None, description="Nucleus sampling mass in (0, 1).", examples=[0.95])
    truncate: int | None = Field(
        None, le=UINT32_MAX, description="Keep only the last N prompt tokens.", examples=[None]
    )
    typical_p: float | None = Field(None, description="Typical decoding mass in (0, 1).", examples=[0.95])
    watermark: bool = Field(False, description="Add a green-list watermark (Kirchenbauer et al.).")
    adapter_id: str | None = Field(None, description="LoRA adapter; absent means the base model.")

    @model_validator(mode="before")
    @classmethod
    def _null_means_absent(cls, data: Any) -> Any:
        # Clients such as huggingface_hub send `"details": null` for unset parameters; treat it as absent.
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class GenerateRequest(_Strict):
    """Body of /generate and /generate_stream."""

    inputs: str = Field(description="The prompt.", examples=["My name is Olivier and I"])
    parameters: GenerateParameters | None = Field(
        None, description="Generation parameters. When the whole object is absent, sampling is on (TGI's quirk)."
    )


class CompatGenerateRequest(GenerateRequest):
    """Body of POST /: a generate request with a `stream` switch."""

    stream: bool = Field(False, description="Answer with server-sent events instead of a JSON list.")


class SimpleToken(BaseModel):
    """One token of /tokenize, with byte offsets into the input."""

    id: int = Field(examples=[0])
    text: str = Field(examples=["test"])
    start: int = Field(description="Byte offset where the token starts.", examples=[0])
    stop: int = Field(description="Byte offset just after the token.", examples=[4])


class PrefillToken(BaseModel):
    """One prompt token; the first has no logprob."""

    id: int = Field(examples=[0])
    text: str = Field(examples=["test"])
    logprob: float | None = Field(examples=[-0.34])


class Token(BaseModel):
    """One generated token."""

    id: int = Field(examples=[0])
    text: str = Field(examples=["test"])
    logprob: float | None = Field(examples=[-0.34])
    special: bool = Field(description="Whether the token is a special token (e.g. EOS).", examples=[False])


class BestOfSequence(_OmitsEmpty):
    """A candidate of best_of that was not chosen."""

    omit_when_empty: ClassVar[tuple[str, ...]] = ("top_tokens",)

    generated_text: str = Field(examples=["test"])
    finish_reason: FinishReason
    generated_tokens: int = Field(examples=[1])
    seed: int | None = Field(examples=[42])
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] = Field(default_factory=list)


class Details(_OmitsEmpty):
    """Details of a /generate answer (only when `details` or `decoder_input_details` was asked)."""

    omit_when_empty: ClassVar[tuple[str, ...]] = ("top_tokens", "best_of_sequences")

    finish_reason: FinishReason = Field(examples=["length"])
    generated_tokens: int = Field(examples=[1])
    seed: int | None = Field(description="The seed used; null when greedy.", examples=[42])
    prefill: list[PrefillToken] = Field(description="Prompt tokens, filled only with decoder_input_details.")
    tokens: list[Token]
    top_tokens: list[list[Token]] = Field(default_factory=list, description="Present only with top_n_tokens.")
    best_of_sequences: list[BestOfSequence] | None = Field(None, description="Present only with best_of > 1.")


class GenerateResponse(_OmitsEmpty):
    """Answer of /generate."""

    omit_when_empty: ClassVar[tuple[str, ...]] = ("details",)

    generated_text: str = Field(examples=["test"])
    details: Details | None = None


class StreamDetails(BaseModel):
    """Details carried by the last event of a stream."""

    finish_reason: FinishReason = Field(examples=["length"])
    generated_tokens: int = Field(examples=[1])
    seed: int | None = Field(examples=[42])
    input_length: int = Field(examples=[1])


class StreamResponse(_OmitsEmpty):
    """One server-sent event of /generate_stream."""

    omit_when_empty: ClassVar[tuple[str, ...]] = ("top_tokens",)

    index: int = Field(description="1-based position of the token.", examples=[1])
    token: Token
    top_tokens: list[Token] = Field(default_factory=list)
    generated_text: str | None = Field(None, description="Set on the last event.", examples=["test"])
    details: StreamDetails | None = Field(None, description="Set on the last event when details were asked.")


class ErrorResponse(BaseModel):
    """Body of every error."""

    error: str = Field(examples=["Input validation error: `inputs` cannot be empty"])
    error_type: str = Field(examples=["validation"])


class Info(BaseModel):
    """Answer of /info (docs/api.md, Info, health and metrics)."""

    model_config = ConfigDict(protected_namespaces=())

    model_id: str = Field(examples=["HuggingFaceTB/SmolLM2-135M-Instruct"])
    model_sha: str | None = None
    model_pipeline_tag: str | None = Field(None, examples=["text-generation"])
    model_dtype: str = Field(examples=["torch.float32"])
    model_device_type: str = Field(examples=["cpu"])
    max_concurrent_requests: int = Field(examples=[128])
    max_best_of: int = Field(examples=[2])
    max_stop_sequences: int = Field(examples=[4])
    max_input_tokens: int = Field(examples=[1024])
    max_total_tokens: int = Field(examples=[2048])
    validation_workers: int = Field(examples=[2])
    max_client_batch_size: int = Field(examples=[4])
    router: str = Field("text-generation-router", examples=["text-generation-router"])
    version: str = Field(examples=["0.1.0"])
    sha: str | None = None
    docker_label: str | None = None
    # TGI's field: draft tokens verified per step (--speculate); 0 when speculative decoding is off.
    speculate: int = Field(0, examples=[0])
    # Kettle's addition: which code runs the model ("native", "transformers" fallback, or "seq2seq").
    execution_path: str | None = Field(None, examples=["native"])
    # Kettle's addition: the weight quantization that serves (null: dense weights in `model_dtype`).
    quantization: str | None = Field(None, examples=["gguf Q4_1+Q8_0 → int4"])
    # Kettle's addition: how decode steps run ("fused CPU step", or "layer by layer" and why).
    decode_path: str | None = Field(None, examples=["fused CPU step"])
    # Kettle's addition: the KV cache's dtype (`--kv-cache-dtype`; null from a shard that does not say).
    kv_cache_dtype: str | None = Field(None, examples=["float32"])
    # Kettle's addition: what its CPU kernels run on a CPU shard (null on a GPU, or without the kernels).
    cpu_kernels: str | None = Field(None, examples=["AVX-512 VNNI"])
