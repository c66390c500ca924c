"""Kettle's environment settings: every `KETTLE_*` variable the code reads, parsed and checked once.

User-facing choices are command-line flags. What stays in the environment is what a user sets once for a machine
(the cache folder, the collectives' timeout, the int4 group and LM head of `--quantize`) and the off switches and
knobs for debugging and measurement (Kettle's CPU kernels and the install's build of them, the library pages a warm
shard drops, the fused decode step and its greedy windows, the float32 tiles and quantized activations of the
int4/int8 kernels and their batch invariance, the CUDA fused kernels and int4 kernel, the attention backend, the CPU
linear layout, the fallback's padding, adaptive prefill chunks, the router's CPU priority, the shortest n-gram
`--speculate` drafts from, the cost it weighs drafts against and the rows a step verifying drafts may feed). The
first `current()` reads them and logs them once; a test that changes the environment calls `reload()`.

Not here: the flags' own environment fallbacks (`KETTLE_NUM_THREADS`, `KETTLE_CPU_KV_CACHE_FRACTION`,
`KETTLE_CUDA_GRAPHS` on the command line), which the CLI reads, `KETTLE_MAX_KV_TOKENS`, which the shard's
warmup reads at each plan.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

INT4_GROUP_SIZES = (32, 64, 128, 256)
LM_HEAD_SCHEMES = ("int8", "int4", "dense")
# tinygemm stays the default: 2.1-2.4x bf16 at one sequence against the Triton kernel's 0.84x; the Triton kernel
# wins at 32 rows and more (0.83-0.90x of bf16 at 32 against tinygemm's 0.34-0.36x; bench/RESULTS.md).
CUDA_INT4_KERNELS = ("tinygemm", "triton")
DEFAULT_DISTRIBUTED_TIMEOUT_S = 300.0
# A decode call's steps within this window reach the streams together: short enough to read as a steady stream,
# long enough to share one round trip to the shard between several steps of a small batch (docs/performance.md).
DEFAULT_DECODE_WINDOW_MS = 50.0
# The router runs at a lower CPU priority than the shards (docs/performance.md, "The router yields the CPU"): on a
# machine whose cores the shards' threads fill, its work then waits for a shard's idle moment instead of taking a
# core from a running step, whose other threads would wait for it at the next barrier.
DEFAULT_ROUTER_NICE = 10


@dataclass(frozen=True)
class Settings:
    """The environment's settings; every field names its variable."""

    cache_dir: Path  # KETTLE_CACHE: converted models and built kernels (default ~/.cache/kettle)
    distributed_timeout_s: float  # KETTLE_DISTRIBUTED_TIMEOUT: a stuck tensor-parallel peer fails after this
    int4_group_size: int | None  # KETTLE_INT4_GROUP_SIZE: None lets a checkpoint's own 4-bit grid decide
    quant_lm_head: str  # KETTLE_QUANT_LM_HEAD: int8, int4 or dense, for --quantize int8/int4
    cpu_kernels: bool  # KETTLE_CPU_KERNELS=0: PyTorch's ops instead of Kettle's C kernels
    installed_kernels: bool  # KETTLE_INSTALLED_KERNELS=0: ignore the kernels built at install; build into the cache
    release_library_pages: bool  # KETTLE_RELEASE_LIBRARY_PAGES=0: keep the library pages start-up ran resident
    cpu_decoder_step: bool  # KETTLE_CPU_DECODER_STEP=0: decode layer by layer instead of one C call
    greedy_window: bool  # KETTLE_GREEDY_WINDOW=0: a decode call's greedy steps one at a time, not in one C call
    cpu_float_rows: int | None  # KETTLE_CPU_FLOAT_ROWS: int4/int8 float32 tiles from N rows (0: never)
    cpu_gemm_rows: int | None  # KETTLE_CPU_GEMM_ROWS: int4/int8 projections on the panels from N rows (0: never)
    cpu_integer_gemm: bool  # KETTLE_CPU_INTEGER_GEMM=0: the float32 panels (16+ rows), not the int16 ones (10+)
    cpu_lanes: bool  # KETTLE_CPU_LANES=0: int4 and Q8_0 weights in rows, not in lanes, on AVX-512 VNNI CPUs
    cpu_prefill_attention: bool  # KETTLE_CPU_PREFILL_ATTENTION=0: SDPA's kernel instead of Kettle's for prefill
    quantized_activations: bool  # KETTLE_QUANTIZED_ACTIVATIONS=0: float32 activations in the int4/int8 GEMVs
    batch_invariant: bool  # KETTLE_BATCH_INVARIANT=0: each row's arithmetic may follow its step's row count (faster)
    cuda_fused_kernels: bool  # KETTLE_FUSED_KERNELS=0: eager ops instead of the Triton norm/RoPE/SiLU kernels
    cuda_int4_kernel: str  # KETTLE_CUDA_INT4_KERNEL: tinygemm (default) or triton, the int4 layers' kernel on CUDA
    cuda_graphs: str | None  # KETTLE_CUDA_GRAPHS: decode graph batch sizes when --cuda-graphs is not given
    attention_backend: str | None  # KETTLE_ATTENTION: sdpa or cuda (default: by device)
    cpu_linear: str  # KETTLE_CPU_LINEAR: onednn, transposed or dense float32 weight layout
    fallback_padding: bool  # KETTLE_FALLBACK_PADDING=0: the transformers fallback runs one request per forward
    adaptive_chunks: bool  # KETTLE_ADAPTIVE_CHUNKS=0: every prefill chunk may take the whole token budget
    overlap: bool  # KETTLE_OVERLAP=1: the shard computes the next decode step while the router handles the last
    decode_window_ms: float  # KETTLE_DECODE_WINDOW_MS: one decode call may run steps for this long (0: one step)
    router_nice: int  # KETTLE_ROUTER_NICE: the router's niceness above the shards' (0: the same priority)
    speculate_min_ngram: int  # KETTLE_SPECULATE_MIN_NGRAM: shortest context match --speculate drafts from (1-8)
    speculate_row_cost: float  # KETTLE_SPECULATE_ROW_COST: a draft token's cost in decode steps (0: always draft)
    speculate_step_rows: int | None  # KETTLE_SPECULATE_STEP_ROWS: rows a step verifying drafts feeds (None: by device)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        """Parses `env` (os.environ); raises ValueError naming the variable for a value it cannot take."""
        cache = env.get("KETTLE_CACHE")
        return cls(
            cache_dir=Path(cache).expanduser() if cache else Path.home() / ".cache" / "kettle",
            distributed_timeout_s=_timeout(env.get("KETTLE_DISTRIBUTED_TIMEOUT")),
            int4_group_size=_group_size(env.get("KETTLE_INT4_GROUP_SIZE")),
            quant_lm_head=_lm_head(env.get("KETTLE_QUANT_LM_HEAD", "int8")),
            cpu_kernels=env.get("KETTLE_CPU_KERNELS", "1") != "0",
            installed_kernels=env.get("KETTLE_INSTALLED_KERNELS", "1") != "0",
            release_library_pages=env.get("KETTLE_RELEASE_LIBRARY_PAGES", "1") != "0",
            cpu_decoder_step=env.get("KETTLE_CPU_DECODER_STEP", "1") != "0",
            greedy_window=env.get("KETTLE_GREEDY_WINDOW", "1") != "0",
            cpu_float_rows=int(env["KETTLE_CPU_FLOAT_ROWS"]) if env.get("KETTLE_CPU_FLOAT_ROWS") else None,
            cpu_gemm_rows=int(env["KETTLE_CPU_GEMM_ROWS"]) if env.get("KETTLE_CPU_GEMM_ROWS") else None,
            cpu_integer_gemm=env.get("KETTLE_CPU_INTEGER_GEMM", "1") != "0",
            cpu_lanes=env.get("KETTLE_CPU_LANES", "1") != "0",
            cpu_prefill_attention=env.get("KETTLE_CPU_PREFILL_ATTENTION", "1") != "0",
            quantized_activations=env.get("KETTLE_QUANTIZED_ACTIVATIONS", "1") != "0",
            batch_invariant=env.get("KETTLE_BATCH_INVARIANT", "1") != "0",
            cuda_fused_kernels=env.get("KETTLE_FUSED_KERNELS", "1") != "0",
            cuda_int4_kernel=_int4_kernel(env.get("KETTLE_CUDA_INT4_KERNEL", "tinygemm")),
            cuda_graphs=env.get("KETTLE_CUDA_GRAPHS"),
            attention_backend=env.get("KETTLE_ATTENTION") or None,
            cpu_linear=env.get("KETTLE_CPU_LINEAR", "onednn"),
            fallback_padding=env.get("KETTLE_FALLBACK_PADDING", "1") != "0",
            adaptive_chunks=env.get("KETTLE_ADAPTIVE_CHUNKS", "1") != "0",
            overlap=env.get("KETTLE_OVERLAP", "0") == "1",
            decode_window_ms=_window(env.get("KETTLE_DECODE_WINDOW_MS")),
            router_nice=_nice(env.get("KETTLE_ROUTER_NICE")),
            speculate_min_ngram=_min_ngram(env.get("KETTLE_SPECULATE_MIN_NGRAM")),
            speculate_row_cost=_row_cost(env.get("KETTLE_SPECULATE_ROW_COST")),
            speculate_step_rows=_step_rows(env.get("KETTLE_SPECULATE_STEP_ROWS")),
        )


def _timeout(value: str | None) -> float:
    seconds = float(value) if value else DEFAULT_DISTRIBUTED_TIMEOUT_S
    if seconds <= 0:
        raise ValueError(f"KETTLE_DISTRIBUTED_TIMEOUT must be a positive number of seconds, got {value!r}")
    return seconds


def _window(value: str | None) -> float:
    milliseconds = float(value) if value else DEFAULT_DECODE_WINDOW_MS
    if milliseconds < 0:
        raise ValueError(f"KETTLE_DECODE_WINDOW_MS must be a number of milliseconds >= 0, got {value!r}")
    return milliseconds


def _nice(value: str | None) -> int:
    if value is None:
        return DEFAULT_ROUTER_NICE
    if value not in {str(n) for n in range(20)}:
        raise ValueError(f"KETTLE_ROUTER_NICE must be a whole number from 0 to 19, got {value!r}")
    return int(value)


def _group_size(value: str | None) -> int | None:
    if value is not None and value not in {str(size) for size in INT4_GROUP_SIZES}:
        raise ValueError(f"KETTLE_INT4_GROUP_SIZE must be 32, 64, 128 or 256, got {value!r}")
    return None if value is None else int(value)


def _int4_kernel(value: str) -> str:
    if value not in CUDA_INT4_KERNELS:
        raise ValueError(f"KETTLE_CUDA_INT4_KERNEL must be tinygemm or triton, got {value!r}")
    return value


def _lm_head(value: str) -> str:
    value = "dense" if value == "0" else value
    if value not in LM_HEAD_SCHEMES:
        raise ValueError(f"KETTLE_QUANT_LM_HEAD must be int8, int4 or dense, got {value!r}")
    return value


def _min_ngram(value: str | None) -> int:
    # 2 by default: on the bundled model's chat answers, the token after a 1-gram match was the model's next token
    # 18% of the time, after a 2-gram match 57% (3-gram 65%, 7 and more ~95%). A verified draft token costs ~0.35
    # of a decode step on the CPU, so drafts from 1-gram matches cost more than they save. The upper bound is
    # kettle.shard.ngram.MAX_NGRAM (written out: this module imports nothing of Kettle's).
    if value is None:
        return 2
    if value not in {str(n) for n in range(1, 9)}:
        raise ValueError(f"KETTLE_SPECULATE_MIN_NGRAM must be a whole number from 1 to 8, got {value!r}")
    return int(value)


def _row_cost(value: str | None) -> float:
    # What one more row (a draft token) adds to a decode step, as a share of a one-row step: measured on the
    # bundled model under int4 with the fused CPU step, 0.3 at context 64 to 0.4 at 540 (each row runs every
    # int4 GEMV and the LM head on its own activations, and attends over the whole context). A GPU step's rows
    # are nearly free: there a lower value drafts more. 0 drafts every step in full, whatever the acceptance.
    try:
        cost = 0.35 if value is None else float(value)
    except ValueError:
        cost = -1.0
    if not 0 <= cost <= 1:
        raise ValueError(f"KETTLE_SPECULATE_ROW_COST must be a number from 0 to 1, got {value!r}")
    return cost


def _step_rows(value: str | None) -> int | None:
    # Unset: kettle/shard/speculation.py's default for the device (one pass of the CPU kernels' integer path, 4;
    # 7 on a GPU). Set, for measurement: 7 is the CPU's rule before it (`python -m bench speculation` compares them).
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"KETTLE_SPECULATE_STEP_ROWS must be a whole number of rows from 1, got {value!r}")
    return int(value)


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
