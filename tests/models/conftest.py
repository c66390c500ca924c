"""Fixtures for the model tests: every module runs torch with one thread; the tiny Llama's warmed engine and
its transformers twin for the engine tests."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.fixtures import torch_threads
from tests.models.engine_driver import warm_engine


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The machine is shared (CI has 2 cores): one thread is plenty for models this size."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    """A warmed ShardEngine on the tiny Llama (one per module)."""
    return warm_engine(tiny_llama_path)[0]


@pytest.fixture(scope="module")
def hf(tiny_llama_path):
    """The tiny Llama's tokenizer and transformers model, float32."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    return tokenizer, model
