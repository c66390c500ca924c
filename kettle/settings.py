"""Kettle's environment settings: every `KETTLE_*` variable the code reads, parsed and checked once.

User-facing choices are command-line flags. A variable of its own is something a user sets once for a machine:
`KETTLE_CACHE` (converted models and built kernels), `KETTLE_DISTRIBUTED_TIMEOUT` (the collectives' timeout),
`KETTLE_INT4_GROUP_SIZE` and `KETTLE_QUANT_LM_HEAD` (the int4 group and LM head of `--quantize`) and
`KETTLE_CUDA_GRAPHS` (the decode graphs when `--cuda-graphs` is not given). The CLI reads the other flags'
environment fallbacks itself (`KETTLE_NUM_THREADS`, `KETTLE_CPU_KV_CACHE_FRACTION`).

The switches and knobs for debugging and measurement share one variable, `KETTLE_TUNING`: comma-separated
`key=value` items, e.g. `KETTLE_TUNING="lanes=off,float-rows=8"`; a switch takes on or off (also 1/0, true/false,
yes/no). An unknown key, an item without `=` or a bad value is an error naming the key, and so is a variable that
one of these keys replaced (the error says which item to set instead). The first `current()` reads the
environment and logs the settings once; a test that changes the environment calls `reload()`.

The keys (`TUNING` below, the one place their defaults are written):

"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

TUNING_VARIABLE = "KETTLE_TUNING"
INT4_GROUP_SIZES = (32, 64, 128, 256)
LM_HEAD_SCHEMES = ("int8", "int4", "dense")
DEFAULT_DISTRIBUTED_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Settings:
    """The environment's settings; each field names its variable or its `KETTLE_TUNING` key (TUNING)."""

    cache_dir: Path  # KETTLE_CACHE: converted models and built kernels (default ~/.cache/kettle)
    distributed_timeout_s: float  # KETTLE_DISTRIBUTED_TIMEOUT: a stuck tensor-parallel peer fails after this
    int4_group_size: int | None  # KETTLE_INT4_GROUP_SIZE: None lets a checkpoint's own 4-bit grid decide
    quant_lm_head: str  # KETTLE_QUANT_LM_HEAD: int8, int4 or dense, for --quantize int8/int4
    cpu_kernels: bool  # cpu-kernels
    installed_kernels: bool  # installed-kernels
    emulate_avx512: bool  # emulate-avx512
    cpu_isa: str  # cpu-isa
    release_library_pages: bool  # release-library-pages
    huge_pages: bool  # huge-pages
    reuse_freed_memory: bool  # reuse-freed-memory
    cpu_decoder_step: bool  # decoder-step
    greedy_window: bool  # greedy-window
    cpu_float_rows: int | None  # float-rows
    cpu_gemm_rows: int | None  # gemm-rows
    cpu_integer_gemm: bool  # integer-gemm
    cpu_lanes: bool  # lanes
    cpu_prefill_attention: bool  # prefill-attention
    quantized_activations: bool  # quantized-activations
    batch_invariant: bool  # batch-invariant
    cuda_fused_kernels: bool  # cuda-fused-kernels
    cuda_int4_kernel: str  # cuda-int4-kernel
    cuda_graphs: str | None  # KETTLE_CUDA_GRAPHS: decode graph batch sizes when --cuda-graphs is not given
    attention_backend: str | None  # attention
    cpu_linear: str  # cpu-linear
    fallback_padding: bool  # fallback-padding
    adaptive_chunks: bool  # adaptive-chunks
    overlap: bool  # overlap
    decode_window_ms: float  # decode-window-ms
    router_nice: int  # router-nice
    speculate_min_ngram: int  # speculate-min-ngram
    speculate_row_cost: float  # speculate-row-cost
    speculate_step_rows: int | None  # speculate-step-rows
    max_kv_tokens: int | None  # max-kv-tokens

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        """Parses `env` (os.environ); raises ValueError naming the variable or KETTLE_TUNING key for a value it
        cannot take, and for a variable KETTLE_TUNING replaced."""
        _refuse_retired(env)
        tuned = {knob.field: knob.default for knob in TUNING.values()}
        for key, value in tuning_items(env.get(TUNING_VARIABLE, "")).items():
            tuned[TUNING[key].field] = _parse_item(key, value)
        cache = env.get("KETTLE_CACHE")
        return cls(
            cache_dir=Path(cache).expanduser() if cache else Path.home() / ".cache" / "kettle",
            distributed_timeout_s=_timeout(env.get("KETTLE_DISTRIBUTED_TIMEOUT")),
            int4_group_size=_group_size(env.get("KETTLE_INT4_GROUP_SIZE")),
            quant_lm_head=_lm_head(env.get("KETTLE_QUANT_LM_HEAD", "int8")),
            cuda_graphs=env.get("KETTLE_CUDA_GRAPHS"),
            **tuned,
        )


# ---- KETTLE_TUNING ---------------------------------------------------------------------------------------------

ON = ("on", "1", "true", "yes")
OFF = ("off", "0", "false", "no")


def _switch(value: str) -> bool:
    if value.lower() in ON:
        return True
    if value.lower() in OFF:
        return False
    raise ValueError("must be on or off (or 1/0, true/false, yes/no)")


def _whole(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(value: str) -> int:
        if not (value.isascii() and value.isdigit()) or not low <= int(value) <= (math.inf if high is None else high):
            raise ValueError(f"must be a whole number from {low}" + (f" to {high}" if high is not None else ""))
        return int(value)

    return parse


def _real(low: float, high: float | None = None) -> Callable[[str], float]:
    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and low <= number <= (math.inf if high is None else high)):
            raise ValueError(
                f"must be a number from {low:g} to {high:g}" if high is not None else f"must be a number >= {low:g}"
            )
        return number

    return parse


def _choice(*names: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in names:
            raise ValueError(f"must be {', '.join(names[:-1])} or {names[-1]}")
        return value

    return parse


@dataclass(frozen=True)
class Knob:
    """One KETTLE_TUNING key: the Settings field it sets, how its value parses, its default and what it does."""

    field: str
    parse: Callable[[str], object]
    default: object
    help: str


TUNING: dict[str, Knob] = {
    "cpu-kernels": Knob("cpu_kernels", _switch, True, "off: PyTorch's ops instead of Kettle's C kernels"),
    "installed-kernels": Knob(
        "installed_kernels", _switch, True, "off: ignore the kernels the install built; build them into the cache"
    ),
    "emulate-avx512": Knob(
        "emulate_avx512",
        _switch,
        False,
        "on: the kernels' AVX-512 paths emulated in software (SIMDe) and taken on any CPU, for their tests; slow",
    ),
    # The names of kettle.kernels.isa.CHOICES (written out: this module imports nothing of Kettle's).
    "cpu-isa": Knob(
        "cpu_isa",
        _choice("auto", "avx2", "avx-vnni"),
        "auto",
        "avx2 or avx-vnni: the CPU kernels as on a CPU without AVX-512 (avx-vnni: with AVX2's VNNI), for measurement",
    ),
    "release-library-pages": Knob(
        "release_library_pages", _switch, True, "off: a warm shard keeps the library pages start-up ran resident"
    ),
    "huge-pages": Knob(
        "huge_pages", _switch, True, "off: packed weights and the KV cache in 4 KiB pages, not 2 MiB ones (Linux THP)"
    ),
    "reuse-freed-memory": Knob(
        "reuse_freed_memory",
        _switch,
        True,
        "off: a shard's large activations in fresh mappings every step (glibc's default), not kept in its heap",
    ),
    "decoder-step": Knob("cpu_decoder_step", _switch, True, "off: decode layer by layer instead of one C call"),
    "greedy-window": Knob("greedy_window", _switch, True, "off: a decode call's greedy steps one C call each"),
    # None: the kernels' own thresholds (kettle/kernels/ops.py).
    "float-rows": Knob(
        "cpu_float_rows", _whole(0), None, "int4/int8 float32 tiles from N rows (0: never; unset: the kernels' own)"
    ),
    "gemm-rows": Knob(
        "cpu_gemm_rows", _whole(0), None, "int4/int8 panels from N rows (0: never; unset: the kernels' own)"
    ),
    "integer-gemm": Knob("cpu_integer_gemm", _switch, True, "off: the float32 panels (16+ rows), not the int8 ones"),
    "lanes": Knob("cpu_lanes", _switch, True, "off: int4 and Q8_0 weights in rows, not lanes (AVX-512 VNNI)"),
    "prefill-attention": Knob(
        "cpu_prefill_attention", _switch, True, "off: SDPA's kernel instead of Kettle's for prefill"
    ),
    "quantized-activations": Knob(
        "quantized_activations", _switch, True, "off: float32 activations in the int4/int8 GEMVs"
    ),
    "batch-invariant": Knob(
        "batch_invariant", _switch, True, "off: a row's arithmetic may follow its step's row count (faster)"
    ),
    "cuda-fused-kernels": Knob(
        "cuda_fused_kernels", _switch, True, "off: eager ops instead of the Triton norm/RoPE/SiLU kernels"
    ),
    # tinygemm stays the default: 2.1-2.4x bf16 at one sequence against the Triton kernel's 0.84x; the Triton
    # kernel wins at 32 rows and more (0.83-0.90x of bf16 at 32 against tinygemm's 0.34-0.36x; bench/RESULTS.md).
    "cuda-int4-kernel": Knob(
        "cuda_int4_kernel",
        _choice("tinygemm", "triton"),
        "tinygemm",
        "tinygemm or triton, the int4 layers' kernel on CUDA",
    ),
    # The names of kettle.layers.attention.BACKENDS (written out: this module imports nothing of Kettle's).
    "attention": Knob("attention_backend", _choice("sdpa", "cuda"), None, "sdpa or cuda (unset: by device)"),
    "cpu-linear": Knob(
        "cpu_linear",
        _choice("onednn", "transposed", "dense"),
        "onednn",
        "onednn, transposed or dense: float32 weights' layout on the CPU",
    ),
    "fallback-padding": Knob(
        "fallback_padding", _switch, True, "off: the transformers fallback runs one request per forward"
    ),
    "adaptive-chunks": Knob(
        "adaptive_chunks", _switch, True, "off: every prefill chunk may take the whole token budget"
    ),
    "overlap": Knob("overlap", _switch, False, "on: the shard computes the next decode step while the router works"),
    # A decode call's steps within this window reach the streams together: short enough to read as a steady
    # stream, long enough to share one round trip to the shard between several steps of a small batch
    # (docs/performance.md).
    "decode-window-ms": Knob(
        "decode_window_ms", _real(0), 50.0, "one decode call may run steps for this long (0: one step)"
    ),
    # The router runs at a lower CPU priority than the shards (docs/performance.md, "The router yields the CPU"):
    # on a machine whose cores the shards' threads fill, its work then waits for a shard's idle moment instead of
    # taking a core from a running step, whose other threads would wait for it at the next barrier.
    "router-nice": Knob("router_nice", _whole(0, 19), 10, "the router's niceness above the shards' (0: the same)"),
    # 2: on the bundled model's chat answers, the token after a 1-gram match was the model's next token 18% of
    # the time, after a 2-gram match 57% (3-gram 65%, 7 and more ~95%). A verified draft token costs ~0.35 of a
    # decode step on the CPU, so drafts from 1-gram matches cost more than they save. The upper bound is
    # kettle.shard.ngram.MAX_NGRAM (written out: this module imports nothing of Kettle's).
    "speculate-min-ngram": Knob(
        "speculate_min_ngram", _whole(1, 8), 2, "shortest context match --speculate drafts from"
    ),
    # What one more row (a draft token) adds to a decode step, as a share of a one-row step: measured on the
    # bundled model under int4 with the fused CPU step, 0.3 at context 64 to 0.4 at 540 (each row runs every
    # int4 GEMV and the LM head on its own activations, and attends over the whole context). A GPU step's rows
    # are nearly free: there a lower value drafts more. 0 drafts every step in full, whatever the acceptance.
    "speculate-row-cost": Knob(
        "speculate_row_cost", _real(0, 1), 0.35, "a draft token's cost in decode steps (0: always draft)"
    ),
    # None: kettle/shard/speculation.py's default for the device (one pass of the CPU kernels' integer path, 4;
    # 7 on a GPU). Set, for measurement: 7 is the CPU's rule before it (`python -m bench speculation` compares).
    "speculate-step-rows": Knob(
        "speculate_step_rows", _whole(1), None, "rows a step verifying drafts may feed (unset: by device)"
    ),
    # None: kettle/shard/warmup.py's DEFAULT_MAX_KV_TOKENS. Read at each plan of the cache.
    "max-kv-tokens": Knob(
        "max_kv_tokens",
        _whole(1),
        None,
        "cap on the KV cache's tokens, for tests and tiny models (unset: the warmup's)",
    ),
}

# The variables the keys replaced (names after the KETTLE_ prefix): one still set is an error saying what to set.
RETIRED = {
    "CPU_KERNELS": "cpu-kernels",
    "INSTALLED_KERNELS": "installed-kernels",
    "RELEASE_LIBRARY_PAGES": "release-library-pages",
    "CPU_DECODER_STEP": "decoder-step",
    "GREEDY_WINDOW": "greedy-window",
    "CPU_FLOAT_ROWS": "float-rows",
    "CPU_GEMM_ROWS": "gemm-rows",
    "CPU_INTEGER_GEMM": "integer-gemm",
    "CPU_LANES": "lanes",
    "CPU_PREFILL_ATTENTION": "prefill-attention",
    "QUANTIZED_ACTIVATIONS": "quantized-activations",
    "BATCH_INVARIANT": "batch-invariant",
    "FUSED_KERNELS": "cuda-fused-kernels",
    "CUDA_INT4_KERNEL": "cuda-int4-kernel",
    "ATTENTION": "attention",
    "CPU_LINEAR": "cpu-linear",
    "FALLBACK_PADDING": "fallback-padding",
    "ADAPTIVE_CHUNKS": "adaptive-chunks",
    "OVERLAP": "overlap",
    "DECODE_WINDOW_MS": "decode-window-ms",
    "ROUTER_NICE": "router-nice",
    "SPECULATE_MIN_NGRAM": "speculate-min-ngram",
    "SPECULATE_ROW_COST": "speculate-row-cost",
    "SPECULATE_STEP_ROWS": "speculate-step-rows",
    "MAX_KV_TOKENS": "max-kv-tokens",
}
RETIRED_PREFIX = "KETTLE_"


def tuning_items(value: str) -> dict[str, str]:
    """KETTLE_TUNING's `key=value` items as written, in order (values not parsed yet); raises ValueError naming
    the key for an item without `=`, an unknown key (listing the known ones) or a key given twice."""
    items: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        key, equals, raw = (part.strip() for part in item.partition("="))
        if not equals:
            raise ValueError(f"{TUNING_VARIABLE}: {key} needs a value ({key}=VALUE), got {item!r}")
        if key not in TUNING:
            raise ValueError(f"{TUNING_VARIABLE}: unknown key {key!r}; the keys are {', '.join(TUNING)}")
        if key in items:
            raise ValueError(f"{TUNING_VARIABLE}: {key} is given twice")
        items[key] = raw
    return items


def _parse_item(key: str, value: str) -> object:
    try:
        return TUNING[key].parse(value)
    except ValueError as exc:
        raise ValueError(f"{TUNING_VARIABLE}: {key} {exc}, got {value!r}") from None


def _spelled(value: object) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def merge_tuning(base: str | None, items: Mapping[str, object]) -> str:
    """The KETTLE_TUNING value `base` (e.g. the environment's) with `items` set (a bool as on/off; None drops the
    key), keeping its other items: how a launcher or benchmark sets a switch for a child process."""
    merged = tuning_items(base or "")
    for key, value in items.items():
        if key not in TUNING:
            raise ValueError(f"{TUNING_VARIABLE}: unknown key {key!r}; the keys are {', '.join(TUNING)}")
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = _spelled(value)
    return ",".join(f"{key}={value}" for key, value in merged.items())


def _refuse_retired(env: Mapping[str, str]) -> None:
    """ValueError when a variable KETTLE_TUNING replaced is set, saying which item to set instead."""
    found = {RETIRED_PREFIX + name: key for name, key in RETIRED.items() if RETIRED_PREFIX + name in env}
    if not found:
        return
    items = {key: _retired_value(TUNING[key], env[name]) for name, key in found.items() if env[name]}
    try:
        value = merge_tuning(env.get(TUNING_VARIABLE), items)
    except ValueError:  # the KETTLE_TUNING set now is wrong too: show the new items alone
        value = merge_tuning(None, items)
    names = " and ".join(found)
    verb = "is" if len(found) == 1 else "are"
    advice = (
        f"set {TUNING_VARIABLE}={value}"
        if value
        else f"unset {'it' if len(found) == 1 else 'them'} ({TUNING_VARIABLE} replaces it)"
    )
    raise ValueError(f"{names} {verb} no longer read: {advice}")


def _retired_value(knob: Knob, value: str) -> str:
    """A retired variable's value as its KETTLE_TUNING item's: a default-on switch was off only at "0", the
    default-off one on only at "1"."""
    if knob.parse is _switch:
        return "off" if (value == "0" if knob.default else value != "1") else "on"
    return value


def _tuning_help() -> str:
    rows = []
    for key, knob in TUNING.items():
        default = "" if knob.default is None else f", default {_spelled(knob.default)}"
        rows.append(f"- `{key}` ({knob.field}{default}): {knob.help}")
    return "\n".join(rows) + "\n"


__doc__ += _tuning_help()


# ---- the variables of their own --------------------------------------------------------------------------------


def _timeout(value: str | None) -> float:
    seconds = float(value) if value else DEFAULT_DISTRIBUTED_TIMEOUT_S
    if seconds <= 0:
        raise ValueError(f"KETTLE_DISTRIBUTED_TIMEOUT must be a positive number of seconds, got {value!r}")
    return seconds


def _group_size(value: str | None) -> int | None:
    if value is not None and value not in {str(size) for size in INT4_GROUP_SIZES}:
        raise ValueError(f"KETTLE_INT4_GROUP_SIZE must be 32, 64, 128 or 256, got {value!r}")
    return None if value is None else int(value)


def _lm_head(value: str) -> str:
    value = "dense" if value == "0" else value
    if value not in LM_HEAD_SCHEMES:
        raise ValueError(f"KETTLE_QUANT_LM_HEAD must be int8, int4 or dense, got {value!r}")
    return value


@functools.cache
def current() -> Settings:
    """This process's settings, read from the environment on first use and logged once."""
    settings = Settings.from_env(os.environ)
    values = (f"{field.name}={getattr(settings, field.name)}" for field in dataclasses.fields(settings))
    log.info("Settings: %s", ", ".join(values))
    return settings


def reload() -> Settings:
    """Reads the environment again (tests that change it; a running server never does)."""
    current.cache_clear()
    return current()
