"""TGI's generate routes: POST /generate, /generate_stream, / (compat) and /tokenize.

The request path itself (permits, validation, best_of, metrics) is `GenerationService`; this module parses
the bodies and shapes TGI's answers: JSON with optional details, or one server-sent event per token.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.params import Depends
from fastapi.responses import JSONResponse

from kettle.router import schemas
from kettle.router.errors import ValidationError
from kettle.router.generation import Collected, GenerationService, Times, record_failure, record_success
from kettle.router.json_body import CheckedRoute
from kettle.router.streaming import SSEResponse, failed_stream, sse_body
from kettle.router.types import IncompleteGeneration, Token, TokenEvent, ValidGenerateRequest

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": schemas.ErrorResponse} for code in (401, 413, 415, 422, 424, 429, 500)
}
# Errors before the stream starts are JSON; spelled out, or FastAPI would list them under text/event-stream.
_STREAM_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": schemas.StreamResponse, "description": "Server-sent events, one `data: StreamResponse` per token"},
    **{
        code: {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        for code in _ERROR_RESPONSES
    },
}
_NO_PARAMS = schemas.GenerateParameters()


async def respond(
    service: GenerationService, body: schemas.GenerateRequest, request: Request, full_text_default: bool
) -> tuple[schemas.GenerateResponse, dict[str, str]]:
    """A whole generation: TGI's response body and headers. The permit is held until the result is in."""
    valid = await service.admit(body, stream=False)
    try:
        results = await service.run_for(request, valid, (body.parameters or _NO_PARAMS).best_of or 1)
    finally:
        service.permits.release()
    prefix = body.inputs if _full_text(body, full_text_default) else ""
    return _generate_response(results, body, prefix), response_headers(service.compute_type, body, results[0])


async def stream(service: GenerationService, body: schemas.GenerateRequest, full_text_default: bool) -> SSEResponse:
    """A streamed generation; the permit is given back when the stream ends, however it ends.

    TGI validates inside the stream: a request that fails validation gets 200 and one error event, not a 422.
    """
    headers = {"x-compute-type": service.compute_type, "x-compute-characters": str(len(body.inputs))}
    try:
        valid = await service.admit(body, stream=True)
    except ValidationError as exc:
        return SSEResponse(sse_body(failed_stream(exc)), headers)  # admit gave the permit back already
    prefix = body.inputs if _full_text(body, full_text_default) else ""
    payloads = _stream_payloads(service, valid, prefix, (body.parameters or _NO_PARAMS).details)
    return SSEResponse(sse_body(payloads), headers, on_close=service.permits.release)


async def _stream_payloads(
    service: GenerationService, valid: ValidGenerateRequest, prefix: str, details: bool
) -> AsyncIterator[schemas.StreamResponse]:
    """One `StreamResponse` per token; the last one carries the text (and details when asked)."""
    collected = Collected(valid)
    try:
        async with aclosing(service.infer.generate(valid)) as events:
            async for event in events:
                collected.add(event)
                if isinstance(event, TokenEvent):
                    yield _stream_response(len(collected.tokens), event, valid, prefix, details)
                if collected.finished:
                    record_success(valid, collected)
                    return
        raise IncompleteGeneration()
    except Exception as exc:
        record_failure(exc)
        raise


def response_headers(compute_type: str, body: schemas.GenerateRequest, best: Collected) -> dict[str, str]:
    """Headers of docs/api.md, Routes: compute time in seconds, the other durations in whole milliseconds."""
    valid, last = best.request, best.last
    assert last is not None and last.end is not None
    times = Times.of(valid, last, last.end.generated_tokens)
    return {
        "x-compute-type": compute_type,
        "x-compute-time": f"{times.total:.6f}",
        "x-compute-characters": str(len(body.inputs)),
        "x-total-time": _ms(times.total),
        "x-validation-time": _ms(valid.validation_time),
        "x-queue-time": _ms(times.queue),
        "x-inference-time": _ms(times.inference),
        "x-time-per-token": _ms(times.per_token),
        "x-prompt-tokens": str(valid.input_length),
        "x-generated-tokens": str(last.end.generated_tokens),
    }


def _ms(seconds: float) -> str:
    return str(int(seconds * 1000))


def _full_text(body: schemas.GenerateRequest, default: bool) -> bool:
    p = body.parameters
    return default if p is None or p.return_full_text is None else p.return_full_text


def _finite(logprob: float | None) -> float | None:
    # NaN marks "no logprob" (the first prompt token) in the proto; JSON has no NaN or infinity.
    return logprob if logprob is not None and math.isfinite(logprob) else None


def _token(token: Token) -> schemas.Token:
    return schemas.Token(id=token.id, text=token.text, logprob=_finite(token.logprob), special=token.special)


def _seed(valid: ValidGenerateRequest) -> int | None:
    return valid.parameters.seed if valid.parameters.do_sample else None


def _sequence(c: Collected, prefix: str) -> schemas.BestOfSequence:
    """One candidate with every detail; `Details` and `best_of_sequences` are both built from it."""
    assert c.last is not None and c.last.end is not None
    prefill = c.prefill if c.request.decoder_input_details else ()
    return schemas.BestOfSequence(
        generated_text=prefix + c.last.end.text,
        finish_reason=c.last.end.finish_reason,
        generated_tokens=c.last.end.generated_tokens,
        seed=_seed(c.request),
        prefill=[schemas.PrefillToken(id=t.id, text=t.text, logprob=_finite(t.logprob)) for t in prefill],
        tokens=[_token(t) for t in c.tokens],
        top_tokens=[[_token(t) for t in step] for step in c.top_tokens] if c.request.top_n_tokens else [],
    )


def _generate_response(
    results: list[Collected], body: schemas.GenerateRequest, prefix: str
) -> schemas.GenerateResponse:
    best = _sequence(results[0], prefix)
    params = body.parameters or _NO_PARAMS
    if not (params.details or params.decoder_input_details):
        return schemas.GenerateResponse(generated_text=best.generated_text)
    others = [_sequence(r, prefix) for r in results[1:]] or None
    fields = {name: getattr(best, name) for name in type(best).model_fields if name != "generated_text"}
    details = schemas.Details(**fields, best_of_sequences=others)
    return schemas.GenerateResponse(generated_text=best.generated_text, details=details)


def _stream_response(
    index: int, event: TokenEvent, valid: ValidGenerateRequest, prefix: str, details: bool
) -> schemas.StreamResponse:
    response = schemas.StreamResponse(
        index=index, token=_token(event.token), top_tokens=[_token(t) for t in event.top_tokens]
    )
    if event.end is None:
        return response
    response.generated_text = prefix + event.end.text
    if details:
        response.details = schemas.StreamDetails(
            finish_reason=event.end.finish_reason,
            generated_tokens=event.end.generated_tokens,
            seed=_seed(valid),
            input_length=valid.input_length,
        )
    return response


def build_router(service: GenerationService, dependencies: Sequence[Depends] = ()) -> APIRouter:
    """The generate routes; `dependencies` (API key, JSON content type) apply to all of them."""
    router = APIRouter(dependencies=list(dependencies), tags=["Text Generation Inference"], route_class=CheckedRoute)

    @router.post("/generate", response_model=schemas.GenerateResponse, responses=_ERROR_RESPONSES)
    async def generate(body: schemas.GenerateRequest, request: Request) -> JSONResponse:
        """Generate tokens."""
        response, headers = await respond(service, body, request, full_text_default=False)
        return JSONResponse(response.model_dump(mode="json"), headers=headers)

    @router.post("/generate_stream", response_class=SSEResponse, status_code=200, responses=_STREAM_RESPONSES)
    async def generate_stream(body: schemas.GenerateRequest) -> SSEResponse:
        """Generate a stream of tokens as server-sent events, one `StreamResponse` per token."""
        return await stream(service, body, full_text_default=False)

    @router.post("/", response_model=list[schemas.GenerateResponse], responses=_ERROR_RESPONSES)
    async def compat_generate(body: schemas.CompatGenerateRequest, request: Request) -> Any:
        """Generate tokens: a JSON list with one answer, or server-sent events when `stream` is true."""
        if body.stream:
            return await stream(service, body, full_text_default=True)
        response, headers = await respond(service, body, request, full_text_default=True)
        return JSONResponse([response.model_dump(mode="json")], headers=headers)

    @router.post("/tokenize", response_model=list[schemas.SimpleToken], responses=_ERROR_RESPONSES)
    async def tokenize(body: schemas.GenerateRequest) -> list[schemas.SimpleToken]:
        """Tokenize the inputs (special tokens added, `truncate` ignored), with byte offsets into the input."""
        return await service.validation.tokenizers.tokenize(body.inputs)

    return router
