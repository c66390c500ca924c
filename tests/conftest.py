"""Shared pytest fixtures and markers: the tiny model is built once per session; settings follow the
environment; each test is marked by its folder (`unit`: no model; `model`: tiny models in process; `e2e`:
real servers), so `pytest -m "unit or model"` (`make test-fast`) runs everything but the server launches."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton's interpreter runs the CUDA backend's kernels on CPU tensors (test_triton_attention.py):
# set before Triton is imported (its decorators read it), then imported, which is what makes Kettle load it where
# there is no GPU (kettle/layers/triton_support.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    with contextlib.suppress(ImportError):
        import triton  # noqa: F401

from kettle import settings
from tests.fixtures import make_tiny_llama, make_tokenizer

MARKERS = {
    "unit": "tests/unit: no model and no server",
    "model": "tests/models: tiny models in this process, against transformers",
    "e2e": "tests/e2e: real launcher, shard and router processes",
}
FOLDER_MARKERS = {"unit": "unit", "models": "model", "e2e": "e2e"}


def pytest_configure(config):
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")
    if settings.current().emulate_avx512:
        _check_the_emulated_build()


def _check_the_emulated_build():
    """`make test-avx512` runs the kernel tests on the emulated AVX-512 build: a build that failed (no SIMDe headers)
    would leave them on PyTorch's ops or the AVX2 paths and pass without testing what they are run for."""
    from kettle.kernels import build, ops

    if build.library() is None or not ops.vnni():
        missing = "the emulated AVX-512 kernels did not build: SIMDe's headers (Debian's libsimde-dev)?"
        pytest.exit(missing, returncode=1)


def pytest_collection_modifyitems(items):
    for item in items:
        marker = FOLDER_MARKERS.get(Path(item.fspath).parent.name)
        if marker is not None:
            item.add_marker(marker)


@pytest.fixture(autouse=True)
def settings_follow_the_environment(monkeypatch):
    """A server reads its KETTLE_* settings once; tests change them per test (`monkeypatch.setenv`), so in the
    test process every read parses the environment as it is then (servers started by tests read it once)."""

    def current() -> settings.Settings:
        return settings.Settings.from_env(os.environ)

    current.cache_clear = lambda: None  # `settings.reload()` then reads the environment as it is, as every read does
    monkeypatch.setattr(settings, "current", current)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    """A 2-layer random-weight Llama with the tiny byte-level BPE tokenizer, saved as safetensors."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """The tiny byte-level BPE tokenizer (covers English, Chinese, emoji)."""
    return make_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))
