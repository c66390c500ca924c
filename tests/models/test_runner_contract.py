"""The runner contract: what the server and the engine decide from a runner's capabilities, for the paged runner
and the transformers runners alike (no execution-path names compared)."""

from __future__ import annotations

import logging

import pytest

from kettle.shard.config import ShardConfig
from kettle.shard.engine import ShardEngine
from kettle.shard.fallback_runner import FallbackRunner
from kettle.shard.runner import PagedRunner
from kettle.shard.runner_protocol import Runner
from kettle.shard.server import build_engine
from tests.fixtures import make_tiny_llama
from tests.models.fallback_helpers import make_tiny_gpt_neo


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama")), make_tiny_gpt_neo(tmp_path_factory.mktemp("neo"))


def test_the_paged_runner_takes_speculation_the_kv_dtype_and_overlap(paths, monkeypatch):
    monkeypatch.setenv("KETTLE_TUNING", "overlap=on")
    engine, info = build_engine(ShardConfig(model_path=str(paths[0]), speculate=3, kv_cache_dtype="bf16"))
    assert isinstance(engine.runner, PagedRunner) and isinstance(engine.runner, Runner)
    assert engine.runner.capabilities.paged and not info.requires_padding
    assert (engine.runner.speculate, info.speculate, info.kv_cache_dtype) == (3, 3, "bfloat16")
    assert engine.overlap


def test_a_transformers_runner_declines_them_and_says_so(paths, monkeypatch, caplog):
    monkeypatch.setenv("KETTLE_TUNING", "overlap=on")
    with caplog.at_level(logging.WARNING):
        engine, info = build_engine(ShardConfig(model_path=str(paths[1]), speculate=3, kv_cache_dtype="bf16"))
    runner = engine.runner
    assert isinstance(runner, FallbackRunner) and isinstance(runner, Runner)
    assert not isinstance(runner, PagedRunner)  # side by side, not a subclass with paged methods it cannot run
    assert info.requires_padding and (runner.speculate, info.speculate) == (0, 0)
    assert info.kv_cache_dtype == "float32"
    assert not engine.overlap and not ShardEngine(runner, 0.1, overlap=True).overlap
    assert "--speculate needs the paged KV cache" in caplog.text
    assert "--kv-cache-dtype applies to the paged KV cache only" in caplog.text
