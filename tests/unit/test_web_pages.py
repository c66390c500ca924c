"""The browser pages' HTTP side (kettle/router/pages.py): the routes, what they send with the HTML, GET /'s
browser redirect beside the health check, and that every file the pages load is served and ships in the wheel.
The pages themselves run in a real browser in tests/e2e/test_web_pages_e2e.py."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from fastapi.testclient import TestClient

from kettle.router import pages

ROOT = Path(__file__).resolve().parents[2]
BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"


def client(api_key_required: bool = False) -> TestClient:
    app = FastAPI()

    @app.get("/")
    async def health() -> PlainTextResponse:  # stands in for the info routes' health check
        return PlainTextResponse("healthy")

    pages.install(app, api_key_required)
    return TestClient(app)


@pytest.mark.parametrize("path", sorted(pages.PAGES))
def test_pages_say_whether_a_key_is_needed_and_forbid_inline_scripts(path):
    for required, expected in ((False, "none"), (True, "required")):
        response = client(required).get(path)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/html")
        assert f'<meta name="kettle-api-key" content="{expected}">' in response.text
        policy = response.headers["content-security-policy"]
        assert "script-src 'self';" in policy and "connect-src 'self'" in policy and "'unsafe-eval'" not in policy
        assert response.headers["x-content-type-options"] == "nosniff"


@pytest.mark.parametrize("path", sorted(pages.PAGES))
def test_every_file_a_page_loads_is_served_from_the_package(path):
    test = client()
    html = test.get(path).text
    # No inline code: the pages' policy would block it, so it would only be dead weight (or a bug).
    assert not re.search(r"<script(?![^>]*\ssrc=)", html) and not re.search(r"\son[a-z]+\s*=", html)
    assets = re.findall(r'(?:src|href)="(/static/[^"]+)"', html)
    assert len(assets) >= 4
    for asset in assets:
        response = test.get(asset)
        assert response.status_code == 200, asset
    for module in re.findall(r'import .* from "\./([^"]+)"', test.get(f"/static/{pages.PAGES[path][:-5]}.js").text):
        assert test.get(f"/static/{module}").status_code == 200, module


def test_root_sends_browsers_to_the_chat_page_and_answers_probes_as_health():
    test = client()
    browser = test.get("/", headers={"Accept": BROWSER_ACCEPT}, follow_redirects=False)
    assert browser.status_code == 307 and browser.headers["location"] == "/chat"
    for accept in ("*/*", "application/json", None):
        headers = {"Accept": accept} if accept else {}
        probe = test.get("/", headers=headers)
        assert probe.status_code == 200 and probe.text == "healthy", accept
    assert test.post("/", headers={"Accept": BROWSER_ACCEPT}).status_code == 405  # only GET is redirected


def test_pages_stay_out_of_the_api_document():
    paths = client().get("/openapi.json").json()["paths"]
    assert not set(pages.PAGES) & set(paths)


def test_vendored_libraries_come_with_their_licenses():
    vendor = pages.STATIC / "vendor"
    libraries = [path for path in vendor.iterdir() if path.suffix in (".js", ".css")]
    assert len(libraries) >= 4
    for library in libraries:
        license_file = vendor / f"{library.name.split('.')[0]}.LICENSE"
        assert license_file.is_file(), library.name
        text = license_file.read_text()
        assert "Permission is hereby granted" in text or "Apache License" in text, library.name
        assert "sourceMappingURL" not in library.read_text()  # the maps are not shipped: no 404 in devtools


def test_the_package_data_ships_every_static_file():
    """A wheel (`pip install .`, the image) holds what pyproject's package data names, globbed from the package's
    folder as setuptools does."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kettle.router"]
    shipped = {path for glob in globs for path in pages.STATIC.parent.glob(glob) if path.is_file()}
    files = {path for path in pages.STATIC.rglob("*") if path.is_file()}
    assert len(files) >= 15
    assert files - shipped == set()
