"""Request bodies as the routes read them: JSON that every later stage can carry.

JSON may spell a lone UTF-16 surrogate (`"\\ud800"`), and Python's parser accepts it; nothing after it can take
one (the tokenizer, the shards' protobuf strings, the grammar engine, the response encoder), and before this
check one such string failed a whole batch. So a body is refused, with a 422 naming the field, before any route
sees it: the routes of the generation API use `CheckedRoute`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from kettle.router.errors import VALIDATION_PREFIX, ValidationError


class InvalidText(ValidationError, StarletteHTTPException):
    """A string of the body that is not valid Unicode (422).

    Also an HTTPException: FastAPI re-raises those as they are while it reads the body (any other error there
    becomes a generic 400).
    """

    def __init__(self, where: str) -> None:
        StarletteHTTPException.__init__(self, 422, f"`{where}` is not valid Unicode: it holds a lone surrogate")

    @property
    def message(self) -> str:
        return VALIDATION_PREFIX + str(self.detail)


def lone_surrogate_at(value: Any) -> str | None:
    """The dotted path (`parameters.stop.0`) of the first string, key or value, with a lone surrogate."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:  # iterative: a deeply nested body must not overflow the interpreter's stack
        where, item = stack.pop()
        if isinstance(item, str):
            if not _is_unicode(item):
                return where or "body"
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                path = f"{where}.{key}" if where else str(key)
                if not _is_unicode(key):
                    return where or "body"
                stack.append((path, child))
        elif isinstance(item, list):
            stack.extend((f"{where}.{i}" if where else str(i), child) for i, child in reversed(list(enumerate(item))))
    return None


def _is_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class CheckedRequest(Request):
    """A request whose `json()` refuses strings that are not valid Unicode."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            raw = await self.body()
            try:
                body = json.loads(raw)  # a decode error stays FastAPI's 400
            except RecursionError:  # nesting deeper than the parser's stack: a bad body, not a server error
                raise ValueError("the JSON body is nested too deeply") from None
            where = lone_surrogate_at(body)
            if where is not None:
                raise InvalidText(where)
            self._json = body
        return self._json


class CheckedRoute(APIRoute):
    """An APIRoute that hands its handler a `CheckedRequest`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            return await handler(CheckedRequest(request.scope, request.receive))

        return checked
