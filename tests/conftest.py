"""Shared pytest fixtures: the tiny model is built once per session; settings follow the environment."""

from __future__ import annotations

import os

import pytest

from kettle import settings
from tests.fixtures import make_tiny_llama, make_tokenizer


@pytest.fixture(autouse=True)
def settings_follow_the_environment(monkeypatch):
    """A server reads its KETTLE_* settings once; tests change them per test (`monkeypatch.setenv`), so in the
    test process every read parses the environment as it is then (servers started by tests read it once)."""
    monkeypatch.setattr(settings, "current", lambda: settings.Settings.from_env(os.environ))


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    """A 2-layer random-weight Llama with the tiny byte-level BPE tokenizer, saved as safetensors."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """The tiny byte-level BPE tokenizer (covers English, Chinese, emoji)."""
    return make_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))
