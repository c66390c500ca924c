"""The FastAPI application: routes, error handlers, payload limit, CORS and the API key.

Route modules each contribute an `APIRouter`; the OpenAI routes share `app.state.generation` (permits,
validation, Infer) and `generation_dependencies` with the TGI routes.
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.params import Depends as DependsParam
from fastapi.security import HTTPBearer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import kettle
from kettle import tracing
from kettle.proto import generate_pb2
from kettle.router import generate, openai, pages
from kettle.router import info as info_routes
from kettle.router.chat_template import ChatTemplate
from kettle.router.config import RouterConfig
from kettle.router.errors import (
    PayloadTooLarge,
    Unauthorized,
    UnsupportedMediaType,
    error_response,
    install_error_handlers,
)
from kettle.router.generation import GenerationService, InferLike, Permits
from kettle.router.info import HealthCheck
from kettle.router.request_log import RequestIdMiddleware
from kettle.router.shutdown import Drain, DrainMiddleware
from kettle.router.tracing import TracingMiddleware
from kettle.router.validation import Validation, ValidationLimits

_DESCRIPTION = "Text generation inference with Hugging Face TGI's API."


class InferService(InferLike, HealthCheck, Protocol):
    """What the app needs from `kettle.router.infer.Infer`."""


def create_app(
    config: RouterConfig,
    infer: InferService,
    validation: Validation,
    info: generate_pb2.InfoResponse,
    limits: ValidationLimits,
    drain: Drain | None = None,
) -> FastAPI:
    """The whole HTTP API; `limits` are the token limits chosen at warmup (shown in /info).

    `drain` is the graceful-shutdown state the server flips on SIGTERM (see shutdown.py).
    """
    app = FastAPI(
        title="Kettle",
        version=kettle.__version__,
        description=_DESCRIPTION,
        openapi_url="/api-doc/openapi.json",
        docs_url="/docs",
        redoc_url=None,
    )
    install_error_handlers(app)
    permits = Permits(config.max_concurrent_requests)
    service = GenerationService(infer, validation, permits, info_routes.compute_type(info), config.adapters)
    app.state.generation = service
    app.include_router(
        info_routes.build_router(infer, info_routes.server_info(config, info, limits, validation.images is not None))
    )
    app.include_router(generate.build_router(service, generation_dependencies(config)))
    template = ChatTemplate.load(Path(config.tokenizer_name), config.tokenizer_config_path)
    routes = openai.OpenAIRoutes(service, template, config.model_id, config.max_client_batch_size)
    app.include_router(openai.build_router(routes, generation_dependencies(config)))
    pages.install(app, api_key_required=bool(config.api_key))  # /chat, /dashboard: browser pages over the public API
    app.add_middleware(InternalErrors)
    app.add_middleware(PayloadLimit, limit=config.payload_limit)
    if config.api_key:  # outside the payload limit: a client without the key gets 401 before any byte is read
        app.add_middleware(ApiKeyGate, key=config.api_key)
    app.state.drain = drain or Drain()
    app.add_middleware(DrainMiddleware, drain=app.state.drain)
    app.add_middleware(RequestIdMiddleware)
    if tracing.enabled():  # off: not even a pass-through layer
        app.add_middleware(TracingMiddleware)
    if config.cors_allow_origin:
        # Added last, so it is the outermost layer: even 413s and 401s carry the CORS headers.
        app.add_middleware(
            CORSMiddleware, allow_origins=list(config.cors_allow_origin), allow_methods=["*"], allow_headers=["*"]
        )
    return app


def generation_dependencies(config: RouterConfig) -> list[DependsParam]:
    """Checks on every generation route: a JSON content type. With `--api-key` the routes also declare the
    bearer scheme, for /docs; `ApiKeyGate` checks the key, before the body is read."""
    scheme = [Depends(_BEARER)] if config.api_key else []
    return [*scheme, Depends(require_json)]


_BEARER = HTTPBearer(auto_error=False, description="The server's `--api-key`.")


class ApiKeyGate:
    """401 for a POST (every generation route, and nothing else) without `Authorization: Bearer <key>`.

    An ASGI layer rather than a route dependency: FastAPI reads and parses the body before it runs dependencies,
    so an unauthenticated client could make the server parse megabytes and get 400 or 413 instead of 401.
    """

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self._key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not self._authorized(scope):
            await error_response(Unauthorized())(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = next((value for name, value in scope.get("headers", ()) if name == b"authorization"), b"")
        scheme, _, token = given.partition(b" ")
        # Constant-time comparison: the key must not leak through response timing.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)


class InternalErrors:
    """Any exception a route lets escape becomes a 500 in TGI's error shape, and the connection stays usable.

    Starlette's outermost handler would answer plain text and re-raise, and the server then drops the
    connection without `Connection: close`, so a keep-alive client's next request fails too.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as error:
            if started:  # half an answer is out: only closing the connection can tell the client
                raise
            await error_response(error)(scope, receive, send)


async def require_json(request: Request) -> None:
    """415 unless the body is declared as JSON (`application/json` or `application/*+json`)."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    kind, _, subtype = media_type.partition("/")
    if kind != "application" or not (subtype == "json" or subtype.endswith("+json")):
        raise UnsupportedMediaType()


class PayloadLimit:
    """413 for request bodies over `limit` bytes, by Content-Length up front or by counting a chunked body."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _content_length(scope) > self.limit:
            await error_response(PayloadTooLarge(self.limit))(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive: Receive) -> Receive:
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise PayloadTooLarge(self.limit)
            return message

        return counted


def _content_length(scope: Scope) -> int:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0
