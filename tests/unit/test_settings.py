"""The settings module: every KETTLE_* variable parsed once, with defaults, and bad values named."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kettle.settings import Settings
from kettle.settings import current as read_once  # the real one: tests/conftest.py makes `current` re-read


def test_defaults_without_any_variable():
    settings = Settings.from_env({})
    assert settings.cache_dir == Path.home() / ".cache" / "kettle"
    assert settings.distributed_timeout_s == 300.0
    assert (settings.int4_group_size, settings.quant_lm_head) == (None, "int8")
    assert settings.cpu_kernels and settings.cpu_decoder_step and settings.cuda_fused_kernels
    assert settings.cuda_graphs is None
    assert settings.decode_window_ms == 50.0 and settings.cpu_gemm_rows is None and settings.cpu_integer_gemm
    assert (settings.speculate_min_ngram, settings.speculate_row_cost) == (2, 0.35)
    assert settings.speculate_step_rows is None and settings.router_nice == 10
    assert settings.cuda_int4_kernel == "tinygemm"


def test_variables_are_parsed():
    env = {"KETTLE_CACHE": "/tmp/k", "KETTLE_CPU_KERNELS": "0", "KETTLE_INT4_GROUP_SIZE": "64"}
    env |= {"KETTLE_QUANT_LM_HEAD": "0", "KETTLE_DISTRIBUTED_TIMEOUT": "12.5"}
    env |= {"KETTLE_SPECULATE_MIN_NGRAM": "1", "KETTLE_SPECULATE_ROW_COST": "0", "KETTLE_SPECULATE_STEP_ROWS": "7"}
    settings = Settings.from_env(env)
    assert (settings.speculate_min_ngram, settings.speculate_row_cost, settings.speculate_step_rows) == (1, 0.0, 7)
    assert settings.cache_dir == Path("/tmp/k") and not settings.cpu_kernels
    assert (settings.int4_group_size, settings.quant_lm_head) == (64, "dense")
    assert settings.distributed_timeout_s == 12.5
    assert Settings.from_env({"KETTLE_DECODE_WINDOW_MS": "0"}).decode_window_ms == 0.0
    assert not Settings.from_env({"KETTLE_CPU_INTEGER_GEMM": "0"}).cpu_integer_gemm
    assert Settings.from_env({"KETTLE_ROUTER_NICE": "0"}).router_nice == 0
    assert Settings.from_env({"KETTLE_CUDA_INT4_KERNEL": "triton"}).cuda_int4_kernel == "triton"


@pytest.mark.parametrize(
    "name, value",
    [
        ("KETTLE_INT4_GROUP_SIZE", "100"),
        ("KETTLE_QUANT_LM_HEAD", "fp4"),
        ("KETTLE_DISTRIBUTED_TIMEOUT", "0"),
        ("KETTLE_DECODE_WINDOW_MS", "-5"),
        ("KETTLE_SPECULATE_MIN_NGRAM", "9"),
        ("KETTLE_SPECULATE_ROW_COST", "-0.1"),
        ("KETTLE_SPECULATE_ROW_COST", "cheap"),
        ("KETTLE_SPECULATE_STEP_ROWS", "0"),
        ("KETTLE_SPECULATE_STEP_ROWS", "many"),
        ("KETTLE_ROUTER_NICE", "20"),
        ("KETTLE_ROUTER_NICE", "-5"),
        ("KETTLE_CUDA_INT4_KERNEL", "marlin"),
    ],
)
def test_a_bad_value_names_its_variable(name, value):
    with pytest.raises(ValueError, match=name):
        Settings.from_env({name: value})


def test_read_once_and_logged_once(monkeypatch, caplog):
    read_once.cache_clear()
    monkeypatch.setenv("KETTLE_CPU_DECODER_STEP", "0")
    with caplog.at_level(logging.INFO, logger="kettle.settings"):
        first = read_once()
        monkeypatch.setenv("KETTLE_CPU_DECODER_STEP", "1")
        assert read_once() is first and not first.cpu_decoder_step
    assert len([r for r in caplog.records if r.message.startswith("Settings:")]) == 1
    read_once.cache_clear()
