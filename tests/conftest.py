"""Shared pytest fixtures: the tiny model is built once per session."""

from __future__ import annotations

import pytest

from tests.fixtures import make_tiny_llama, make_tokenizer


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    """A 2-layer random-weight Llama with the tiny byte-level BPE tokenizer, saved as safetensors."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """The tiny byte-level BPE tokenizer (covers English, Chinese, emoji)."""
    return make_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))
