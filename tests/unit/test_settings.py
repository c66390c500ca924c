"""The settings module: the KETTLE_* variables and KETTLE_TUNING's keys parsed once, with defaults, bad values
named, and the variables KETTLE_TUNING replaced refused with the item to set instead."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest

from kettle import settings
from kettle.settings import RETIRED, TUNING, Settings, merge_tuning, tuning_items
from kettle.settings import current as read_once  # the real one: tests/conftest.py makes `current` re-read

ROOT = Path(__file__).resolve().parents[2]
# The variables of their own (docs/architecture.md, "Settings"); every other switch is a KETTLE_TUNING key.
KEPT = {
    "KETTLE_CACHE",
    "KETTLE_DISTRIBUTED_TIMEOUT",
    "KETTLE_INT4_GROUP_SIZE",
    "KETTLE_QUANT_LM_HEAD",
    "KETTLE_NUM_THREADS",
    "KETTLE_CPU_KV_CACHE_FRACTION",
    "KETTLE_CUDA_GRAPHS",
    "KETTLE_TUNING",
}
# The defaults before KETTLE_TUNING, when each key was a variable of its own.
OLD_DEFAULTS = {
    "cpu_kernels": True,
    "installed_kernels": True,
    "emulate_avx512": False,
    "cpu_isa": "auto",
    "release_library_pages": True,
    "huge_pages": True,
    "reuse_freed_memory": True,
    "cpu_decoder_step": True,
    "greedy_window": True,
    "cpu_float_rows": None,
    "cpu_gemm_rows": None,
    "cpu_integer_gemm": True,
    "cpu_lanes": True,
    "cpu_prefill_attention": True,
    "quantized_activations": True,
    "batch_invariant": True,
    "cuda_fused_kernels": True,
    "cuda_int4_kernel": "tinygemm",
    "attention_backend": None,
    "cpu_linear": "onednn",
    "fallback_padding": True,
    "adaptive_chunks": True,
    "overlap": False,
    "decode_window_ms": 50.0,
    "router_nice": 10,
    "speculate_min_ngram": 2,
    "speculate_row_cost": 0.35,
    "speculate_step_rows": None,
    "max_kv_tokens": None,
}
# A value each key takes (not its default) and the field's value then.
GOOD = {
    "cpu-kernels": ("off", False),
    "installed-kernels": ("off", False),
    "emulate-avx512": ("on", True),
    "cpu-isa": ("avx2", "avx2"),
    "release-library-pages": ("off", False),
    "huge-pages": ("off", False),
    "reuse-freed-memory": ("off", False),
    "decoder-step": ("off", False),
    "greedy-window": ("off", False),
    "float-rows": ("8", 8),
    "gemm-rows": ("0", 0),
    "integer-gemm": ("off", False),
    "lanes": ("off", False),
    "prefill-attention": ("off", False),
    "quantized-activations": ("off", False),
    "batch-invariant": ("off", False),
    "cuda-fused-kernels": ("off", False),
    "cuda-int4-kernel": ("triton", "triton"),
    "attention": ("sdpa", "sdpa"),
    "cpu-linear": ("dense", "dense"),
    "fallback-padding": ("off", False),
    "adaptive-chunks": ("off", False),
    "overlap": ("on", True),
    "decode-window-ms": ("0", 0.0),
    "router-nice": ("0", 0),
    "speculate-min-ngram": ("1", 1),
    "speculate-row-cost": ("0", 0.0),
    "speculate-step-rows": ("7", 7),
    "max-kv-tokens": ("65536", 65536),
}


def tuned(value: str) -> Settings:
    return Settings.from_env({"KETTLE_TUNING": value})


def test_defaults_without_any_variable():
    settings_ = Settings.from_env({})
    assert settings_.cache_dir == Path.home() / ".cache" / "kettle"
    assert settings_.distributed_timeout_s == 300.0
    assert (settings_.int4_group_size, settings_.quant_lm_head) == (None, "int8")
    assert settings_.cuda_graphs is None
    assert {field: getattr(settings_, field) for field in OLD_DEFAULTS} == OLD_DEFAULTS


def test_the_table_covers_every_field_once():
    fields = {field.name for field in dataclasses.fields(Settings)}
    tuned_fields = [knob.field for knob in TUNING.values()]
    assert len(tuned_fields) == len(set(tuned_fields)) and set(tuned_fields) == set(OLD_DEFAULTS)
    assert fields - set(tuned_fields) == {
        "cache_dir",
        "distributed_timeout_s",
        "int4_group_size",
        "quant_lm_head",
        "cuda_graphs",
    }
    # every knob but those added after the separate variables were retired replaced a variable of its own
    added = {"huge-pages", "reuse-freed-memory", "emulate-avx512", "cpu-isa"}
    assert set(GOOD) == set(TUNING) and set(RETIRED.values()) == set(TUNING) - added


@pytest.mark.parametrize("key", list(TUNING))
def test_every_key_parses(key):
    value, expected = GOOD[key]
    assert getattr(tuned(f"{key}={value}"), TUNING[key].field) == expected


def test_variables_are_parsed():
    env = {"KETTLE_CACHE": "/tmp/k", "KETTLE_INT4_GROUP_SIZE": "64", "KETTLE_CUDA_GRAPHS": "1,2"}
    env |= {"KETTLE_QUANT_LM_HEAD": "0", "KETTLE_DISTRIBUTED_TIMEOUT": "12.5"}
    env |= {"KETTLE_TUNING": "cpu-kernels=off, speculate-min-ngram=1,speculate-row-cost=0,speculate-step-rows=7,"}
    parsed = Settings.from_env(env)
    assert (parsed.speculate_min_ngram, parsed.speculate_row_cost, parsed.speculate_step_rows) == (1, 0.0, 7)
    assert parsed.cache_dir == Path("/tmp/k") and not parsed.cpu_kernels
    assert (parsed.int4_group_size, parsed.quant_lm_head) == (64, "dense")
    assert (parsed.distributed_timeout_s, parsed.cuda_graphs) == (12.5, "1,2")
    assert tuned("").cpu_lanes and tuned(" , ").cpu_lanes


@pytest.mark.parametrize("spelling, on", [("on", True), ("1", True), ("true", True), ("YES", True)])
@pytest.mark.parametrize("off", ["off", "0", "false", "No"])
def test_switches_take_every_spelling(spelling, on, off):
    assert tuned(f"overlap={spelling}").overlap is on
    assert tuned(f"lanes={off}").cpu_lanes is False


@pytest.mark.parametrize(
    "name, value",
    [
        ("KETTLE_INT4_GROUP_SIZE", "100"),
        ("KETTLE_QUANT_LM_HEAD", "fp4"),
        ("KETTLE_DISTRIBUTED_TIMEOUT", "0"),
    ],
)
def test_a_bad_value_names_its_variable(name, value):
    with pytest.raises(ValueError, match=name):
        Settings.from_env({name: value})


@pytest.mark.parametrize(
    "key, value, meaning",
    [
        ("decode-window-ms", "-5", ">= 0"),
        ("decode-window-ms", "nan", ">= 0"),
        ("speculate-min-ngram", "9", "from 1 to 8"),
        ("speculate-row-cost", "-0.1", "from 0 to 1"),
        ("speculate-row-cost", "cheap", "from 0 to 1"),
        ("speculate-step-rows", "0", "from 1"),
        ("speculate-step-rows", "many", "from 1"),
        ("router-nice", "20", "from 0 to 19"),
        ("router-nice", "-5", "from 0 to 19"),
        ("cuda-int4-kernel", "marlin", "tinygemm or triton"),
        ("attention", "flash", "sdpa or cuda"),
        ("cpu-linear", "mkl", "onednn, transposed or dense"),
        ("lanes", "maybe", "on or off"),
        ("float-rows", "-1", "whole number"),
        ("max-kv-tokens", "0", "whole number"),
        ("overlap", "", "on or off"),
    ],
)
def test_a_bad_value_names_its_key(key, value, meaning):
    with pytest.raises(ValueError, match=f"KETTLE_TUNING: {key} must be .*{re.escape(meaning)}.*, got {value!r}"):
        tuned(f"{key}={value}")


def test_an_unknown_key_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown key 'lane'") as raised:
        tuned("overlap=on,lane=off")
    assert all(key in str(raised.value) for key in TUNING)


def test_an_item_without_a_value_or_given_twice_names_its_key():
    with pytest.raises(ValueError, match="KETTLE_TUNING: lanes needs a value"):
        tuned("lanes")
    with pytest.raises(ValueError, match="KETTLE_TUNING: lanes is given twice"):
        tuned("lanes=off,lanes=on")


@pytest.mark.parametrize(
    "env, message",
    [
        ({"KETTLE_CPU_LANES": "0"}, "KETTLE_CPU_LANES is no longer read: set KETTLE_TUNING=lanes=off"),
        ({"KETTLE_OVERLAP": "1"}, "KETTLE_OVERLAP is no longer read: set KETTLE_TUNING=overlap=on"),
        ({"KETTLE_FUSED_KERNELS": "0"}, "set KETTLE_TUNING=cuda-fused-kernels=off"),
        ({"KETTLE_MAX_KV_TOKENS": "4096"}, "set KETTLE_TUNING=max-kv-tokens=4096"),
        ({"KETTLE_ATTENTION": ""}, "KETTLE_ATTENTION is no longer read: unset it"),
        (
            {"KETTLE_CPU_LANES": "0", "KETTLE_ROUTER_NICE": "0", "KETTLE_TUNING": "float-rows=8"},
            "KETTLE_CPU_LANES and KETTLE_ROUTER_NICE are no longer read: "
            "set KETTLE_TUNING=float-rows=8,lanes=off,router-nice=0",
        ),
    ],
)
def test_a_variable_tuning_replaced_is_refused_with_the_item_to_set(env, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Settings.from_env(env)


@pytest.mark.parametrize("name", sorted(RETIRED))
def test_every_old_variable_is_refused(name):
    with pytest.raises(ValueError, match=f"KETTLE_{name} is no longer read: set KETTLE_TUNING={RETIRED[name]}="):
        Settings.from_env({f"KETTLE_{name}": "0" if TUNING[RETIRED[name]].default is not None else "7"})


def test_merge_adds_replaces_and_drops_items():
    assert merge_tuning(None, {"cpu-kernels": False}) == "cpu-kernels=off"
    assert merge_tuning("lanes=off,overlap=on", {"overlap": None, "float-rows": 8}) == "lanes=off,float-rows=8"
    assert merge_tuning("lanes=off", {"lanes": True}) == "lanes=on"
    assert tuning_items(" lanes = off ,overlap=on") == {"lanes": "off", "overlap": "on"}
    with pytest.raises(ValueError, match="unknown key 'fused'"):
        merge_tuning(None, {"fused": False})


def test_the_attention_names_are_the_backends():
    from kettle.layers.attention import BACKENDS

    for name in BACKENDS:
        assert tuned(f"attention={name}").attention_backend == name
    with pytest.raises(ValueError):
        tuned("attention=" + "-".join(BACKENDS))


def test_the_docstring_and_the_docs_list_every_key():
    assert all(f"`{key}`" in settings.__doc__ for key in TUNING)
    documented = re.findall(r"^\| `([a-z0-9-]+)` \|", (ROOT / "docs" / "architecture.md").read_text(), re.M)
    assert documented == list(TUNING)


def test_kettle_names_only_the_kept_variables():
    """Every KETTLE_* name written anywhere in kettle/ (code, comments, docstrings; header guards aside) is one
    of the kept variables: the switches are KETTLE_TUNING keys."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "kettle").rglob("*"):
        if path.suffix not in {".py", ".c", ".h"}:
            continue
        for name in re.findall(r"KETTLE_[A-Z0-9_]+", path.read_text(errors="replace")):
            if not name.endswith("_H"):
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    assert {name: files for name, files in found.items() if name not in KEPT} == {}


def test_read_once_and_logged_once(monkeypatch, caplog):
    read_once.cache_clear()
    monkeypatch.setenv("KETTLE_TUNING", "decoder-step=off")
    with caplog.at_level(logging.INFO, logger="kettle.settings"):
        first = read_once()
        monkeypatch.setenv("KETTLE_TUNING", "decoder-step=on")
        assert read_once() is first and not first.cpu_decoder_step
    assert len([r for r in caplog.records if r.message.startswith("Settings:")]) == 1
    read_once.cache_clear()


def test_reload_reads_the_environment_again(monkeypatch):
    monkeypatch.setattr(settings, "current", read_once)  # the cached one, as a server has it
    monkeypatch.setenv("KETTLE_TUNING", "max-kv-tokens=4096")
    try:
        assert settings.reload().max_kv_tokens == 4096
        monkeypatch.setenv("KETTLE_TUNING", "")
        assert settings.reload().max_kv_tokens is None
    finally:
        read_once.cache_clear()
