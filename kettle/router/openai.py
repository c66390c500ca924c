"""The OpenAI-compatible routes (docs/api.md, OpenAI routes): /v1/chat/completions, /v1/completions, /v1/models,
/chat_tokenize and SageMaker's /invocations.

Every generation goes through the same `GenerationService` as /generate (permits, validation, metrics); this
module renders chat prompts, maps the fields (openai_mapping.py) and shapes the answers and streams.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pydantic
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.params import Depends
from fastapi.responses import JSONResponse, Response

import kettle
from kettle.router import generate
from kettle.router import openai_mapping as mapping
from kettle.router import openai_schemas as oai
from kettle.router.chat_template import ChatTemplate
from kettle.router.errors import ValidationError
from kettle.router.generation import Collected, GenerationService, record_failure, record_success, until_disconnect
from kettle.router.json_body import CheckedRoute
from kettle.router.openai_stream import Meta, chat_chunks, completion_events, openai_error_event
from kettle.router.schemas import CompatGenerateRequest, ErrorResponse, GenerateRequest
from kettle.router.streaming import SSEResponse, sse_body
from kettle.router.tool_stream import call_id
from kettle.router.tools import check_tool_schemas, parse_output, plan_tools
from kettle.router.types import ValidGenerateRequest

_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (401, 413, 415, 422, 424, 429)}


@dataclass(frozen=True)
class OpenAIRoutes:
    """What the routes share: the request path, the chat template and the facts answers repeat."""

    service: GenerationService
    template: ChatTemplate | None
    model_id: str
    max_client_batch_size: int

    def _on_adapter(self, generate_body: GenerateRequest, model: str | None) -> GenerateRequest:
        """`model` naming a loaded LoRA adapter runs the request with it; any other name is the base model."""
        if model in self.service.adapters:
            generate_body.parameters.adapter_id = model
        return generate_body

    def meta(self, prefix: str) -> Meta:
        fingerprint = f"{kettle.__version__}-kettle"
        return Meta(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), self.model_id, fingerprint)

    async def chat(self, body: oai.ChatRequest, request: Request) -> Response:
        """A chat completion, JSON or streamed."""
        takes_images = self.service.validation.images is not None
        mapping.check_chat_supported(body, takes_images)
        await asyncio.to_thread(check_tool_schemas, body.tools)  # compiling a large schema must not stall the loop
        tools = plan_tools(body.tools, body.tool_choice)
        prompt, add_special_tokens = mapping.chat_prompt(self.template, body, tools, takes_images)
        generate_body = self._on_adapter(mapping.chat_request(body, prompt, tools), body.model)
        images = mapping.chat_image_refs(body) if takes_images else None
        valid = await self.service.admit(
            generate_body, stream=body.stream, add_special_tokens=add_special_tokens, images=images
        )
        meta, logprobs = self.meta("chatcmpl"), bool(body.logprobs)
        if body.stream:
            chunks = chat_chunks(self.service, valid, meta, _include_usage(body), logprobs, tools is not None)
            return self._sse(chunks, [valid], prompt)
        try:
            best = (await self.service.run_for(request, valid))[0]
        finally:
            self.service.permits.release()
        answer = _chat_completion(meta, best, logprobs, tools is not None)
        headers = generate.response_headers(self.service.compute_type, generate_body, best)
        return JSONResponse(answer.model_dump(mode="json"), headers=headers)

    async def completions(self, body: oai.CompletionRequest, request: Request) -> Response:
        """Legacy completions: one choice per prompt, the prompts generated concurrently."""
        prompts = mapping.check_completion_supported(body, self.max_client_batch_size)
        bodies = [self._on_adapter(mapping.completion_request(body, p), body.model) for p in prompts]
        valids = await self._admit_all(bodies, body.stream)
        meta = self.meta("cmpl")
        if body.stream:
            events = completion_events(self.service, valids, meta, _include_usage(body), body.logprobs is not None)
            return self._sse(events, valids, "".join(prompts))
        try:
            results = await _run_all(self.service, request, valids)
        finally:
            for _ in valids:
                self.service.permits.release()
        choices = [_completion_choice(i, r, body.logprobs is not None) for i, r in enumerate(results)]
        answer = oai.Completion(**meta.fields(), choices=choices, usage=mapping.usage(results))
        return JSONResponse(answer.model_dump(mode="json"), headers={"x-compute-type": self.service.compute_type})

    async def chat_tokenize(self, body: oai.ChatRequest) -> oai.ChatTokenizeResponse:
        takes_images = self.service.validation.images is not None
        mapping.check_content(body.messages, takes_images)
        tools = plan_tools(body.tools, body.tool_choice)
        prompt, add_special_tokens = mapping.chat_prompt(self.template, body, tools, takes_images)
        tokens = await self.service.validation.tokenizers.tokenize(prompt, add_special_tokens)
        return oai.ChatTokenizeResponse(tokenize_response=tokens, templated_text=prompt)

    async def _admit_all(self, bodies: Sequence[GenerateRequest], stream: bool) -> list[ValidGenerateRequest]:
        """One permit and one validation per prompt; if any fails, the permits already taken are given back."""
        valids: list[ValidGenerateRequest] = []
        try:
            for body in bodies:
                valids.append(await self.service.admit(body, stream=stream))
        except BaseException:
            for _ in valids:
                self.service.permits.release()
            raise
        return valids

    def _sse(self, payloads: Any, valids: Sequence[ValidGenerateRequest], prompt: str) -> SSEResponse:
        def release() -> None:
            for _ in valids:
                self.service.permits.release()

        body = sse_body(payloads, openai_error_event, done_marker=True)
        headers = {"x-compute-type": self.service.compute_type, "x-compute-characters": str(len(prompt))}
        return SSEResponse(body, headers, on_close=release)


def _include_usage(body: oai.SamplingFields) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


async def _run_all(service: GenerationService, request: Request, valids: Sequence[ValidGenerateRequest]) -> list:
    """Every prompt at once, all cancelled if the client leaves or one fails; metrics per prompt."""
    try:
        batches = await until_disconnect(request, asyncio.gather(*(service.run(v) for v in valids)))
    except BaseException as exc:
        record_failure(exc)
        raise
    results = [batch[0] for batch in batches]
    for valid, result in zip(valids, results, strict=True):
        record_success(valid, result)
    return results


def _chat_completion(meta: Meta, best: Collected, logprobs: bool, tools: bool) -> oai.ChatCompletion:
    assert best.last is not None and best.last.end is not None
    message, finish = (
        oai.AssistantMessage(content=best.last.end.text),
        mapping.finish_reason(best.last.end.finish_reason),
    )
    if tools:
        message, finish = _tool_message(best.last.end.text, finish)
    choice = oai.ChatChoice(
        index=0,
        message=message,
        logprobs=mapping.token_logprobs(best.tokens, best.top_tokens) if logprobs else None,
        finish_reason=finish,
    )
    return oai.ChatCompletion(**meta.fields(), choices=[choice], usage=mapping.usage([best]))


def _tool_message(text: str, finish: str) -> tuple[oai.AssistantMessage, Any]:
    """The answer of a tool output: a text answer for `no_tool`, else one call (finish reason `tool_calls`)."""
    call = parse_output(text)
    if call.content is not None:
        return oai.AssistantMessage(content=call.content), finish
    function = oai.FunctionCall(name=call.name, arguments=call.arguments)
    return oai.AssistantMessage(
        content=None, tool_calls=[oai.ToolCall(id=call_id(), type="function", function=function)]
    ), "tool_calls"


def _completion_choice(index: int, result: Collected, logprobs: bool) -> oai.CompletionChoice:
    assert result.last is not None and result.last.end is not None
    end = result.last.end
    choice = oai.CompletionChoice(index=index, text=end.text, finish_reason=mapping.finish_reason(end.finish_reason))
    if logprobs:
        choice.logprobs = mapping.completion_logprobs(result.tokens, result.top_tokens)
    return choice


def _parse(model: type[pydantic.BaseModel], data: Any) -> Any:
    """A body parsed as FastAPI would, so /invocations answers bad fields with the usual 422."""
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


def build_router(routes: OpenAIRoutes, dependencies: Sequence[Depends] = ()) -> APIRouter:
    """The OpenAI routes; `dependencies` (API key, JSON content type) apply to the POST ones."""
    router = APIRouter(tags=["OpenAI"], route_class=CheckedRoute)
    checked = list(dependencies)

    @router.post("/v1/chat/completions", dependencies=checked, response_model=oai.ChatCompletion, responses=_ERRORS)
    async def chat_completions(body: oai.ChatRequest, request: Request) -> Response:
        """Chat completion: JSON, or `chat.completion.chunk` server-sent events ending with `[DONE]`."""
        return await routes.chat(body, request)

    @router.post("/v1/completions", dependencies=checked, response_model=oai.Completion, responses=_ERRORS)
    async def completions(body: oai.CompletionRequest, request: Request) -> Response:
        """Legacy completions for one prompt or a list of them."""
        return await routes.completions(body, request)

    @router.get("/v1/models", response_model=oai.ModelList)
    async def models() -> oai.ModelList:
        """The one model this server runs."""
        names = [routes.model_id, *routes.service.adapters]  # the base model, then each LoRA adapter
        modalities = ["text", "image"] if routes.service.validation.images is not None else []
        models = [oai.Model(id=name, owned_by=routes.model_id, input_modalities=modalities) for name in names]
        return oai.ModelList(data=models)

    @router.post("/chat_tokenize", dependencies=checked, response_model=oai.ChatTokenizeResponse, responses=_ERRORS)
    async def chat_tokenize(body: oai.ChatRequest) -> oai.ChatTokenizeResponse:
        """The chat prompt rendered by the template, and its tokens with byte offsets."""
        return await routes.chat_tokenize(body)

    @router.post("/invocations", dependencies=checked, responses=_ERRORS)
    async def invocations(request: Request) -> Response:
        """SageMaker: `inputs` → generate (like POST /), `messages` → chat, `prompt` → completions."""
        try:
            data = await request.json()
        except ValueError:
            return JSONResponse({"error": "Failed to parse the request body as JSON", "error_type": "bad_request"}, 400)
        if isinstance(data, dict) and "messages" in data:
            return await routes.chat(_parse(oai.ChatRequest, data), request)
        if isinstance(data, dict) and "prompt" in data:
            return await routes.completions(_parse(oai.CompletionRequest, data), request)
        if isinstance(data, dict) and "inputs" in data:
            return await _compat_generate(routes.service, _parse(CompatGenerateRequest, data), request)
        raise ValidationError("the body needs `inputs`, `messages` or `prompt`")

    return router


async def _compat_generate(service: GenerationService, body: CompatGenerateRequest, request: Request) -> Response:
    if body.stream:
        return await generate.stream(service, body, full_text_default=True)
    response, headers = await generate.respond(service, body, request, full_text_default=True)
    return JSONResponse([response.model_dump(mode="json")], headers=headers)
