"""HTTP errors of the TGI API (docs/api.md, Errors): every failure answers `{"error": str, "error_type": str}`.

Two families of exceptions reach the handlers: `ApiError` (raised by the HTTP side: validation, permits, auth,
body checks) and `InferError` (raised by `Infer.generate`, defined in types.py). Both carry `status` and
`error_type`, so one function turns either into a status and a body, for JSON answers and SSE error events alike.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kettle.router.types import InferError

logger = logging.getLogger(__name__)

VALIDATION_PREFIX = "Input validation error: "


class ApiError(Exception):
    """An error the HTTP side raises on purpose; `message` is what the client reads."""

    status = 500
    error_type = "internal"

    @property
    def message(self) -> str:
        return str(self)


class ValidationError(ApiError):
    """A request that breaks a rule of docs/api.md, Validation; made with the bare rule text, sent with the prefix."""

    status = 422
    error_type = "validation"

    @property
    def message(self) -> str:
        return VALIDATION_PREFIX + str(self)


class TemplateError(ApiError):
    """The chat template is missing or failed to render."""

    status = 422
    error_type = "template_error"

    @property
    def message(self) -> str:
        return f"Template error: {self}"


class Overloaded(ApiError):
    """No concurrency permit was free."""

    status = 429
    error_type = "overloaded"

    def __init__(self) -> None:
        super().__init__("Model is overloaded")


class Unauthorized(ApiError):
    """Missing or wrong `Authorization: Bearer` key on a generation route."""

    status = 401
    error_type = "unauthorized"

    def __init__(self) -> None:
        super().__init__("Unauthorized")


class UnsupportedMediaType(ApiError):
    """A body sent without `Content-Type: application/json`."""

    status = 415
    error_type = "unsupported_media_type"

    def __init__(self) -> None:
        super().__init__("Expected request with `Content-Type: application/json`")


class PayloadTooLarge(ApiError, StarletteHTTPException):
    """A body over `--payload-limit` bytes.

    Also an HTTPException: when the limit is crossed while FastAPI reads a chunked body, FastAPI re-raises
    HTTPExceptions as they are (any other error there becomes a 400).
    """

    status = 413
    error_type = "payload_too_large"

    def __init__(self, limit: int) -> None:
        StarletteHTTPException.__init__(self, 413, f"Request body is larger than the payload limit of {limit} bytes")

    @property
    def message(self) -> str:
        return str(self.detail)


def error_body(message: str, error_type: str) -> dict[str, str]:
    """The body of every TGI error, JSON answer or SSE event."""
    return {"error": message, "error_type": error_type}


def describe(exc: BaseException) -> tuple[int, dict[str, str]]:
    """Status and body for any exception a route can meet; unknown ones are logged and reported as incomplete."""
    if isinstance(exc, ApiError):
        return exc.status, error_body(exc.message, exc.error_type)
    if isinstance(exc, InferError):
        return exc.status, error_body(str(exc), exc.error_type)
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return 500, error_body("Incomplete generation", "incomplete_generation")


def error_response(exc: BaseException) -> JSONResponse:
    status, body = describe(exc)
    return JSONResponse(body, status_code=status)


def _pydantic_message(exc: RequestValidationError) -> str:
    """One line naming each bad field, e.g. `parameters.max_new_tokens: Input should be a valid integer`."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        message = "not a field this server supports" if error.get("type") == "extra_forbidden" else error.get("msg")
        parts.append(f"{where}: {message}" if where else str(message))
    return "; ".join(parts)


async def _on_api_error(_: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)


async def _on_request_validation(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    # FastAPI reports unparsable JSON as a validation error; TGI (axum) answers 400 for it.
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = errors[0].get("ctx", {}).get("error", "invalid JSON")
        return JSONResponse(error_body(f"Failed to parse the request body as JSON: {detail}", "bad_request"), 400)
    return JSONResponse(error_body(VALIDATION_PREFIX + _pydantic_message(exc), "validation"), 422)


async def _on_http_exception(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    error_type = str(exc.detail).lower().replace(" ", "_")
    return JSONResponse(error_body(str(exc.detail), error_type), exc.status_code, headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Routes every error the app can raise to the TGI error shape."""
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(InferError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_request_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
