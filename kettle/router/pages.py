"""The browser pages: a chat page (/chat) and a live dashboard (/dashboard), served on the API port.

Both are static files inside the package (kettle/router/static/, no build step, no CDN: the few libraries they
use are vendored with their licenses under static/vendor/), and they only call the public API from the browser:
/v1/chat/completions, /v1/models, /info and /metrics. Nothing here runs on the server but handing out files.

GET / stays TGI's health check; only a browser asking for HTML is sent on to /chat, so probes, curl and load
balancers (which send `Accept: */*` or nothing) get the health answer as before.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from starlette.responses import RedirectResponse
from starlette.types import ASGIApp, Receive, Scope, Send

STATIC = Path(__file__).with_name("static")
PAGES = {"/chat": "chat.html", "/dashboard": "dashboard.html"}
# Defence in depth beside the Markdown renderer's escaping and DOMPurify: even if model output reached the DOM as
# markup, no inline script or handler could run, and the pages can only talk to this server. Inline styles stay
# allowed because the plotting library sizes its elements with style attributes.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
# The placeholder each page carries where the server says whether it needs an API key (the pages ask for the key
# up front instead of waiting for a first 401). Whether a key is needed is no secret: any POST's 401 tells.
_KEY_MARKER = "@API_KEY@"


def install(app: FastAPI, api_key_required: bool) -> None:
    """Adds the pages, their static files under /static, and the browser redirect from GET /."""
    app.include_router(build_router(api_key_required))
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.add_middleware(BrowserHome)


def build_router(api_key_required: bool) -> APIRouter:
    router = APIRouter(include_in_schema=False)  # pages, not API: they stay out of /docs and the OpenAPI document
    needed = "required" if api_key_required else "none"
    for path, name in PAGES.items():
        html = (STATIC / name).read_text(encoding="utf-8").replace(_KEY_MARKER, needed)
        router.add_api_route(path, _page(html), methods=["GET"], name=f"page{path}")
    return router


def _page(html: str):
    async def page() -> HTMLResponse:
        return HTMLResponse(html, headers=SECURITY_HEADERS)

    return page


class BrowserHome:
    """GET / from a browser (its Accept header names text/html) → 307 to /chat; every other GET / is health."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"] == "/" and _wants_html(scope):
            await RedirectResponse("/chat", status_code=307)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _wants_html(scope: Scope) -> bool:
    accept = next((value for name, value in scope.get("headers", ()) if name == b"accept"), b"")
    return b"text/html" in accept.lower()
