"""The container images' recipes, CPU (Dockerfile) and CUDA (Dockerfile.cuda): the shared install script, TGI's
port, volume and entry point.

No image is built here (that needs a container daemon and the base images); each Dockerfile is read instruction
by instruction instead, and each convention it promises is checked against the CLI that will run inside it.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from typer.main import get_command

from kettle.cli import app

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ["Dockerfile", "Dockerfile.cuda"]


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    lines = [line for line in (ROOT / name).read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    pairs = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            pairs.append((word.upper(), rest.strip()))
    return pairs


def values(name: str, instruction: str) -> list[str]:
    return [rest for word, rest in instructions(name) if word == instruction]


def env(name: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for rest in values(name, "ENV"):
        pairs.update(item.split("=", 1) for item in shlex.split(rest))
    return pairs


def install_run(name: str) -> str:
    (run,) = [rest for rest in values(name, "RUN") if "scripts/install.sh" in rest]
    return run


def launch_options() -> dict:
    return {opt: p for p in get_command(app).commands["launch"].params for opt in p.opts}


def test_the_cpu_image_is_a_slim_python_with_the_cpu_torch():
    (base,) = values("Dockerfile", "FROM")
    assert re.fullmatch(r"python:3\.1[1-9]-slim", base)
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu " in install_run("Dockerfile")


def test_the_cuda_image_is_an_nvidia_runtime_with_the_torch_of_its_cuda_version():
    (base,) = values("Dockerfile.cuda", "FROM")
    image = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-(?:cudnn-)?runtime-ubuntu(\d+)\.04", base)
    assert image, base
    major, minor, ubuntu = image.groups()
    # Ubuntu 24.04's python3 is 3.12; 22.04's 3.10 is below the floor pyproject.toml sets.
    assert int(ubuntu) >= 24 and 'requires-python = ">=3.11"' in (ROOT / "pyproject.toml").read_text()
    # torch's wheels for the base image's CUDA version (13.0 → cu130), through the script's own variable.
    index = re.search(r"TORCH_INDEX_URL=(\S+)", install_run("Dockerfile.cuda"))
    assert index and index.group(1) == f"https://download.pytorch.org/whl/cu{major}{minor}"
    # The interpreter the install fills is the one whose `kettle` the entry point finds first on PATH.
    python = re.search(r"PYTHON=(\S+)", install_run("Dockerfile.cuda")).group(1)
    assert env("Dockerfile.cuda")["PATH"].split(":")[0] == str(Path(python).parent)


@pytest.mark.parametrize("name", IMAGES)
def test_each_image_runs_the_shared_install_script(name: str):
    run = install_run(name)
    assert "scripts/install.sh runtime" in run and "EDITABLE=0" in run
    # The same script `make serve` runs, and the variable it reads for the torch build.
    assert "scripts/install.sh runtime" in (ROOT / "Makefile").read_text()
    assert "TORCH_INDEX_URL" in (ROOT / "scripts" / "install.sh").read_text()


@pytest.mark.parametrize("name", IMAGES)
def test_the_build_context_holds_what_the_install_script_needs(name: str):
    copied = {source.rstrip("/") for rest in values(name, "COPY") for source in shlex.split(rest)[:-1]}
    assert {"pyproject.toml", "README.md", "scripts", "kettle"} <= copied
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    for needed in ("pyproject.toml", "README.md", "scripts/", "kettle/"):
        assert f"!{needed}" in ignored


@pytest.mark.parametrize("name", IMAGES)
def test_tgi_conventions_port_80_and_the_data_volume(name: str):
    variables = env(name)
    assert variables["PORT"] == "80" and values(name, "EXPOSE") == ["80"]
    assert variables["HUGGINGFACE_HUB_CACHE"] == "/data" and values(name, "VOLUME") == ["/data"]
    assert variables["HF_HOME"] == "/data" and variables["KETTLE_CACHE"].startswith("/data/")
    # Those variables are the ones `kettle launch` reads.
    params = launch_options()
    assert params["--port"].envvar == "PORT"
    assert params["--huggingface-hub-cache"].envvar == "HUGGINGFACE_HUB_CACHE"


@pytest.mark.parametrize("name", IMAGES)
def test_arguments_go_to_kettle_launch(name: str):
    (entrypoint,) = values(name, "ENTRYPOINT")
    assert json.loads(entrypoint) == ["kettle", "launch"]
    (cmd,) = values(name, "CMD")
    assert json.loads(cmd) == ["--json-output"]
    flags = [word for word in json.loads(cmd) if word.startswith("-")]
    assert set(flags) <= set(launch_options())


def test_the_documented_run_lines_name_flags_the_launcher_has():
    """The `docker run` lines in the images' headers and docs/deployment.md pass launcher flags that exist."""
    options = launch_options()
    texts = [(ROOT / name).read_text() for name in IMAGES] + [(ROOT / "docs" / "deployment.md").read_text()]
    lines = [re.sub(r"\\\n#?\s*", " ", text) for text in texts]
    runs = [line for text in lines for line in text.splitlines() if re.match(r"#?\s*docker run ", line)]
    assert any("--gpus all" in run for run in runs)
    checked = 0
    for run in runs:
        words = run.split()
        image = next(i for i, word in enumerate(words) if re.fullmatch(r"kettle(-cuda)?", word))
        for flag in (word for word in words[image + 1 :] if word.startswith("--")):
            assert flag in options, f"{flag} in {run!r}"
            checked += 1
    assert checked >= len(IMAGES)
