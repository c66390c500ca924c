"""The container image's recipe: the shared install script, TGI's port, volume and entry point.

No image is built here (that needs a container daemon and the base image); the Dockerfile is read instruction
by instruction instead, and each convention it promises is checked against the CLI that will run inside it.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from typer.main import get_command

from kettle.cli import app

ROOT = Path(__file__).resolve().parents[2]


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    lines = [line for line in (ROOT / "Dockerfile").read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    pairs = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            pairs.append((word.upper(), rest.strip()))
    return pairs


def values(name: str) -> list[str]:
    return [rest for word, rest in instructions() if word == name]


def env() -> dict[str, str]:
    pairs: dict[str, str] = {}
    for rest in values("ENV"):
        pairs.update(item.split("=", 1) for item in shlex.split(rest))
    return pairs


def test_the_image_is_a_slim_python_that_runs_the_shared_install_script():
    (base,) = values("FROM")
    assert re.fullmatch(r"python:3\.1[1-9]-slim", base)
    runs = [rest for rest in values("RUN") if "scripts/install.sh" in rest]
    assert len(runs) == 1 and "scripts/install.sh runtime" in runs[0]
    # The same script `make serve` runs.
    assert "scripts/install.sh runtime" in (ROOT / "Makefile").read_text()


def test_the_build_context_holds_what_the_install_script_needs():
    copied = {source.rstrip("/") for rest in values("COPY") for source in shlex.split(rest)[:-1]}
    assert {"pyproject.toml", "README.md", "scripts", "kettle"} <= copied
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    for needed in ("pyproject.toml", "README.md", "scripts/", "kettle/"):
        assert f"!{needed}" in ignored


def test_tgi_conventions_port_80_and_the_data_volume():
    variables = env()
    assert variables["PORT"] == "80" and values("EXPOSE") == ["80"]
    assert variables["HUGGINGFACE_HUB_CACHE"] == "/data" and values("VOLUME") == ["/data"]
    assert variables["KETTLE_CACHE"].startswith("/data/")
    # Those variables are the ones `kettle launch` reads.
    params = {opt: p for p in get_command(app).commands["launch"].params for opt in p.opts}
    assert params["--port"].envvar == "PORT"
    assert params["--huggingface-hub-cache"].envvar == "HUGGINGFACE_HUB_CACHE"


def test_arguments_go_to_kettle_launch():
    (entrypoint,) = values("ENTRYPOINT")
    assert json.loads(entrypoint) == ["kettle", "launch"]
    (cmd,) = values("CMD")
    assert json.loads(cmd) == ["--json-output"]
