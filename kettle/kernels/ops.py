"""Tensor-level calls into Kettle's CPU kernels (kettle/kernels/cpu_kernels.c), one ctypes call each.

Callers check `available()` (or `fits`, which also checks device and dtype; the build is cached, so a check is a
dictionary lookup) and keep PyTorch's ops as the other path. The wrappers take float32 tensors, write into a
fresh output tensor, and pass PyTorch's thread count to the kernels' parallel loops. The attention kernels also
take a KV cache in float16 or bfloat16 (`--kv-cache-dtype`): they widen its rows as they read them and round
the new rows to nearest-even as they write them; their math stays float32.

The row counts below pick the projections' fastest kernels when batch invariance is off (`batch_invariant`,
`KETTLE_BATCH_INVARIANT=0`); by default each row keeps one arithmetic whatever the step's row count, and they only
pick between kernels of the same bits.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from kettle import settings
from kettle.kernels.build import library

# Activations quantized to int16 per block of 32 for integer dot products in the int4/int8 GEMVs: faster than
# dequantizing every weight to float on AVX2, at ~1e-5 relative error on the outputs (kernels.h says why not
# int8). `KETTLE_QUANTIZED_ACTIVATIONS=0`: float32 activations, exactly the dequantized weights' products.
QUANTIZED_ACTIVATIONS = settings.current().quantized_activations
# From these many activation rows on, the int4/int8 kernels dequantize each output channel once and multiply every
# row in float32 (kernels.h's float32 tiles, exact to the dequantized weights): per row that is one FMA per 8
# weights, against the integer path's per-block conversions and scale products. Measured on the bundled model's
# shapes (2 AVX2 cores): int4 wins from 8 rows (16 rows: 1.3x), int8's cheaper integer path only from ~32.
# `KETTLE_CPU_FLOAT_ROWS`: 0 never (the integer path at every size), N from N rows for both.
_FLOAT_ROWS = settings.current().cpu_float_rows
Q4_FLOAT_ROWS = (8 if _FLOAT_ROWS is None else _FLOAT_ROWS) or 1 << 62
Q8_FLOAT_ROWS = (32 if _FLOAT_ROWS is None else _FLOAT_ROWS) or 1 << 62
# From this many rows on (prompt chunks, and decode steps of 16 streams or more, in the fused step too), the
# int4/int8 kernels are gemm.c's blocked GEMM: the weight dequantized panel by panel into a cache-sized buffer
# (written through a register transpose) that a register-blocked micro-kernel multiplies with every row. At 16 rows
# it beat the float32 tiles on the bundled model's shapes (down_proj 133 vs 170 us, the whole fused step 1.10x;
# equal at 8 rows), and Q8_0's head there matches the quantized activations (1.8x them at 32 rows).
# `KETTLE_CPU_GEMM_ROWS`: N from N rows for both kinds of panel (below), 0 never (the tiles above at every size).
_GEMM_ROWS = settings.current().cpu_gemm_rows  # None: the defaults
GEMM_ROWS = (16 if _GEMM_ROWS is None else _GEMM_ROWS) or 1 << 62
# The integer panels (below) pay for their 16 lanes from fewer rows: a group of 10-15 rows padded to 16 costs what
# 16 do, which is less than the few-row paths' passes (bundled model, Zen 4, 2 threads, the fused step at 12 and
# 14 sequences: 30.3 / 36.8-38.2 ms on the float32 tiles, 24.0 / 24.1-25.0 ms on the panels; 10 rows 27.2-29.5
# against 22.8-26.9 ms; 8 rows no better). Where they run, the panels start at 10 rows.
INTEGER_ROWS = (10 if _GEMM_ROWS is None else _GEMM_ROWS) or 1 << 62
# Where the CPU has AVX-512 VNNI, those panels multiply int16 rows (quantized as for one row) with the weights
# widened to int16 (`vpdpwssd`): half the instructions of the float32 micro-kernel per weight and row, so past the
# float32 FMA peak. On the bundled model (Zen 4, 2 threads): the decode step of 16 streams 1.47x, a 1,000-token
# prefill 1.3x. The outputs then carry the activations' int16 rounding (~1e-5 relative), as one row of decode's
# do; `KETTLE_CPU_INTEGER_GEMM=0` keeps the float32 panels, exact to the dequantized weights.
_INTEGER_GEMM = settings.current().cpu_integer_gemm
# int4 and Q8_0 weights in lanes (kettle/quantization/q4.py `to_lanes`, q8.py) where the
# CPU has AVX-512 VNNI; `KETTLE_CPU_LANES=0` keeps the rows layouts, for measurement.
_LANES = settings.current().cpu_lanes

# A weight in lanes (`lanes()`) keeps its own kernel up to here: the panels widen every weight again per call,
# which a batch of decode rows does not amortize (the bundled model's 4 layers, op by op, 2 threads, measured with
# 4 rows a pass: 16 rows 2.8 against 4.3 ms on the panels, 64 rows 7.2 against 10.0, 128 and 256 even, 512 rows 81
# against 72).
LANES_GEMM_ROWS = 128

# Activation rows the int4/int8 kernels' integer path (and the float32 tiles) take in one pass over the weights:
# kernels.h's MAX_TILE. A fifth row starts a second pass, which unpacks every weight again (the fused step on the
# bundled model at context 560: 4 rows 2.30x a one-row step, 5 rows 3.01x; kettle/shard/speculation.py sizes its
# verification steps by it).
TILE_ROWS = 4
# The same for weights in lanes (kernels.h's LANES_TILE: 8 rows of 16 channels' accumulators in AVX-512's 32
# registers). On the bundled model a speculative step of 5 rows (`--speculate 4`'s 4 drafts) then copied 2.06x
# against 1.60x at 4 rows in the same run (2026-11-27, `python -m bench speculation --in-process`).
LANES_TILE_ROWS = 8

# The KV cache element types the attention kernels read and write, by their code in kernels.h (KV_F32, ...).
KV_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

# Prefill attention on kettle_paged_prefill (prefill_attention.c); `KETTLE_CPU_PREFILL_ATTENTION=0`: SDPA's kernel.
PREFILL_ATTENTION = settings.current().cpu_prefill_attention


def available() -> bool:
    """True when the kernels are built and switched on (`KETTLE_CPU_KERNELS`)."""
    return library() is not None


def batch_invariant() -> bool:
    """Whether each row of a step is computed exactly as that row alone would be, whatever else shares the step
    (`KETTLE_BATCH_INVARIANT`, on by default; read at each call): the same request then gives the same tokens alone
    and in any batch. The projections pick their kernels so (below), the decode attention cuts each context as it
    would cut it alone (`paged_decode`), and kettle/kernels/kernels.h says how a row's arithmetic is fixed. Off, the
    kernels pick their fastest arithmetic for the step's row count, as the thresholds above say."""
    return settings.current().batch_invariant


def integer_gemm() -> bool:
    """Whether the panels (`panel_rows()` rows and more) are the integer ones (switched on, AVX-512 VNNI here)."""
    return _INTEGER_GEMM and QUANTIZED_ACTIVATIONS and _has_vnni()


@functools.cache
def _has_vnni() -> bool:
    return bool(library().kettle_integer_gemm_supported())


def lanes() -> bool:
    """Whether int4 and Q8_0 weights (with a multiple of 16 output channels) are stored in lanes here (kernels.h's
    Q4L and Q8L layouts: AVX-512 VNNI, and not switched off by `KETTLE_CPU_LANES=0`)."""
    return available() and _LANES and _has_vnni()


def panel_rows(lanes: bool = False) -> int:
    """Rows from which the int4/int8 projections run gemm.c's panels: INTEGER_ROWS where those are the integer
    panels (unless GEMM_ROWS is lower), GEMM_ROWS where they are the float32 ones; for a weight in lanes not
    before LANES_GEMM_ROWS."""
    rows = min(GEMM_ROWS, INTEGER_ROWS) if integer_gemm() else GEMM_ROWS
    return max(rows, LANES_GEMM_ROWS) if lanes else rows


# The several-row entries' paths (cpu_kernels.c `linear_rows`): the float32 tiles, the float32 panels, the integer
# panels (over whole blocks of 32 inputs), and each row as alone (the rows layouts under batch invariance: kernels.h
# `linear_channel_rows`, gemm.c's row panels).
ROWS_TILES, ROWS_GEMM, ROWS_INT_GEMM, ROWS_INVARIANT = 0, 1, 2, 3


def _rows_path(rows: int, k: int, lanes: bool = False) -> int:
    """The several-row entries' path without batch invariance: the float32 tiles below the panels, then the integer
    panels or the float32 ones."""
    if rows < panel_rows(lanes):
        return ROWS_TILES
    return ROWS_INT_GEMM if k % 32 == 0 and integer_gemm() else ROWS_GEMM


def _lanes_invariant(rows: int) -> bool:
    """Under batch invariance, whether a weight in lanes takes the integer panels (else its lanes kernel): both keep
    a row's block sums and add them in one order, so the choice is speed alone (`LANES_GEMM_ROWS`)."""
    return rows >= panel_rows(lanes=True)


@dataclass(frozen=True)
class RowKinds:
    """A forward's token rows by kind: which are prompt rows (`is_prompt`, [count] bool) and which decode rows (a
    decode step's, a speculative step's verification rows), as int64 indices into the `count` rows."""

    is_prompt: torch.Tensor
    prompt: torch.Tensor
    decode: torch.Tensor
    spans: tuple[tuple[int, int] | None, tuple[int, int] | None]  # each kind's [start, end) when its rows are one run

    @classmethod
    def of(cls, is_prompt: torch.Tensor) -> RowKinds:
        prompt, decode = is_prompt.nonzero().squeeze(1), (~is_prompt).nonzero().squeeze(1)
        return cls(is_prompt, prompt, decode, (_span(prompt), _span(decode)))

    @property
    def count(self) -> int:
        return self.is_prompt.shape[0]


def _span(rows: torch.Tensor) -> tuple[int, int] | None:
    """[first, last + 1) when the ascending indices `rows` are one run, else None."""
    if not rows.numel():
        return None
    first, last = int(rows[0]), int(rows[-1])
    return (first, last + 1) if last - first + 1 == rows.numel() else None


_ROW_KINDS: contextvars.ContextVar[RowKinds | None] = contextvars.ContextVar("kettle_row_kinds", default=None)


@contextlib.contextmanager
def _kinds(kinds: RowKinds | None) -> Iterator[None]:
    token = _ROW_KINDS.set(kinds)
    try:
        yield
    finally:
        _ROW_KINDS.reset(token)


def row_kinds(count: int, prompt: Sequence[tuple[int, int]]) -> contextlib.AbstractContextManager:
    """Inside the block, a projection over `count` rows (a model's layers over a forward's tokens) knows which of
    them are prompt rows (the [start, end) ranges of `prompt`) and which decode rows. Under batch invariance a
    weight in the rows layouts (every weight on an AVX2 CPU) runs each kind by its own arithmetic, fixed per row:
    prompt rows the prompt GEMM (gemm.c's panels, whose sums for a row do not depend on how many rows a chunk has)
    and decode rows a row's arithmetic alone (`ROWS_INVARIANT`), so a prompt keeps its GEMM's speed and a decode row
    its bits whatever shares the step. Outside the block (the LM head, a test's call) every row is a decode row."""
    if not batch_invariant():
        return contextlib.nullcontext()
    is_prompt = torch.zeros(count, dtype=torch.bool)
    for start, end in prompt:
        is_prompt[start:end] = True
    return _kinds(RowKinds.of(is_prompt))


def gathered_rows(rows: torch.Tensor) -> contextlib.AbstractContextManager:
    """Inside the block (within `row_kinds`), a projection over the forward's rows `rows` (an expert's share of
    them, gathered) runs each by its kind as the whole forward's would."""
    kinds = _ROW_KINDS.get()
    return _kinds(None if kinds is None else RowKinds.of(kinds.is_prompt[rows.cpu()]))


Run = Callable[[torch.Tensor, bool, torch.Tensor | None], torch.Tensor]


def _by_kind(x: torch.Tensor, n: int, run: Run) -> torch.Tensor:
    """run(rows, prompt, out) over x's prompt rows (prompt True) and its decode rows, each kind in one call, into
    one [M, N] output (`row_kinds`: x holds the forward's rows, else every row is a decode row). A kind whose rows
    are one run (the usual step: its sequences' tokens side by side) is read and written in place (`out`: its rows
    of the output), else gathered and scattered."""
    kinds = _ROW_KINDS.get()
    if kinds is None or kinds.count != x.shape[0] or not kinds.prompt.numel():
        return run(x, False, None)
    if not kinds.decode.numel():
        return run(x, True, None)
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    for rows, span, prompt in ((kinds.prompt, kinds.spans[0], True), (kinds.decode, kinds.spans[1], False)):
        if span is not None:
            run(x[span[0] : span[1]], prompt, y[span[0] : span[1]])
        else:
            y.index_copy_(0, rows, run(x.index_select(0, rows), prompt, None))
    return y


def _by_kind_here(lanes: bool = False) -> bool:
    """Whether a weight runs its rows by kind (`row_kinds`): under batch invariance with int16 rows, in the rows
    layouts (a weight in lanes computes a row alike on both its kernels)."""
    return batch_invariant() and QUANTIZED_ACTIVATIONS and not lanes


def _prompt_path(k: int) -> int:
    """The several-row entries' path for prompt rows in the rows layouts under batch invariance: the integer panels
    where they run, else the float32 ones, at any chunk size (each row's sums there follow the row alone)."""
    return ROWS_INT_GEMM if k % 32 == 0 and integer_gemm() else ROWS_GEMM


def q4_entry(rows: int, k: int, lanes: bool = False) -> tuple[str, int]:
    """`q4_linear`'s entry for `rows` rows of K inputs: ("rows", path) for `kettle_q4_linear_rows`, ("qa", 0) for
    int16 rows on the one-pass kernels (`kettle_q4_linear_qa`), ("plain", 0) for float32 rows on them."""
    if batch_invariant():
        if not QUANTIZED_ACTIVATIONS:  # float32 rows, each over its own chains at any count (lanes: the tiles)
            return ("rows", ROWS_TILES) if lanes else ("plain", 0)
        if not lanes:
            return "rows", ROWS_INVARIANT
        return ("rows", ROWS_INT_GEMM) if _lanes_invariant(rows) else ("qa", 0)
    # From here the float32 tiles or the panel GEMM (the decode step's choice). Lanes keep int16 rows below the
    # panels; with float32 activations they always take the several-row entry (its tiles below the panels).
    several = min(Q4_FLOAT_ROWS, panel_rows())
    if lanes:
        several = panel_rows(lanes=True) if QUANTIZED_ACTIVATIONS else 0
    if rows >= several:
        return "rows", _rows_path(rows, k, lanes)
    return ("qa", 0) if QUANTIZED_ACTIVATIONS else ("plain", 0)  # plain: the rows layout only


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def q4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
    lanes: bool = False,
    supers: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] float32 · Wᵀ (+ bias) for W in the Q4 layout (`kettle.quantization.q4`; `mins` None: a symmetric
    weight, minimum = -8 · scale), or in lanes (`lanes`, `to_lanes`; `supers`: with Q4_K's scales): [M, N] float32."""
    k = x.shape[1]
    weight = (packed, scales, mins, group_size, bias, lanes, supers)
    if _by_kind_here(lanes):
        return _by_kind(
            x,
            packed.shape[0],
            lambda part, prompt, out: _q4(part, *weight, ("rows", _prompt_path(k)) if prompt else None, out),
        )
    return _q4(x, *weight, None)


def _q4(x, packed, scales, mins, group_size, bias, lanes, supers, entry, out=None) -> torch.Tensor:
    """`q4_linear` by `entry` (None: `q4_entry`'s for x's row count), into `out` when given ([M, N] contiguous)."""
    rows, k = x.shape
    n = packed.shape[0]
    x = x.contiguous()
    y = torch.empty(rows, n, dtype=torch.float32) if out is None else out
    head = (x.data_ptr(), k, rows, k, packed.data_ptr(), scales.data_ptr(), _ptr(mins), n, group_size)
    tail = (_ptr(bias), y.data_ptr(), n)
    entry, path = entry or q4_entry(rows, k, lanes)
    if entry == "rows":
        status = library().kettle_q4_linear_rows(*head, lanes, _ptr(supers), *tail, path, torch.get_num_threads())
    elif entry == "qa":
        status = library().kettle_q4_linear_qa(*head, lanes, _ptr(supers), *tail, torch.get_num_threads())
    else:  # the rows layout only: lanes, with or without Q4_K's scales, always take one of the entries above
        status = library().kettle_q4_linear(*head, *tail, torch.get_num_threads())
    if status:
        raise MemoryError("CPU kernel: out of memory for the activations or weight rows")
    return y


def q4_dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    lanes: bool = False,
    supers: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Q4 weight (in lanes when `lanes`; with Q4_K's scales when `supers`) as a dense float32 [N, K] tensor."""
    n, k = packed.shape[0], packed.shape[1] * 2
    out = torch.empty(n, k, dtype=torch.float32)
    library().kettle_q4_dequantize(
        packed.data_ptr(), scales.data_ptr(), _ptr(mins), n, k, group_size, lanes, _ptr(supers), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def q6_path(rows: int, k: int) -> int:
    """`kettle_q6_linear`'s path for `rows` rows of K inputs, as for the other weights in lanes: -1 its lanes kernel
    (int16 rows), from the lanes' panel row count on 1 the float32 panels or 2 the integer ones; 0 the float32 tiles
    where quantized activations are off (`KETTLE_QUANTIZED_ACTIVATIONS=0`; under batch invariance at every count)."""
    if batch_invariant():
        if not QUANTIZED_ACTIVATIONS:
            return ROWS_TILES
        return ROWS_INT_GEMM if _lanes_invariant(rows) else -1
    if rows >= panel_rows(lanes=True):
        return _rows_path(rows, k, lanes=True)
    return -1 if QUANTIZED_ACTIVATIONS else 0


def q6_linear(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [M, K] float32 · Wᵀ (+ bias) for GGUF's Q6_K in lanes (kettle/quantization/q6.py): [M, N] float32."""
    rows, k = x.shape
    n = scales.shape[0]
    x = x.contiguous()
    y = torch.empty(rows, n, dtype=torch.float32)
    status = library().kettle_q6_linear(
        x.data_ptr(), k, rows, k, weight.data_ptr(), scales.data_ptr(), d.data_ptr(), n, _ptr(bias), y.data_ptr(), n,
        q6_path(rows, k), torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise MemoryError("CPU kernel: out of memory for the activations or weight rows")
    return y


def q6_rows(
    weight: torch.Tensor, scales: torch.Tensor, d: torch.Tensor, ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows `ids` of a Q6_K weight in lanes (every row when None) as float32 [len(ids), K]: gguf's values."""
    n, k = scales.shape[0], scales.shape[1] * 16
    ids = None if ids is None else _row_ids(ids, n)
    count = n if ids is None else ids.numel()
    out = torch.empty(count, k, dtype=torch.float32)
    library().kettle_q6_rows(
        weight.data_ptr(), scales.data_ptr(), d.data_ptr(), n, k, _ptr(ids), count, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def q8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 · Wᵀ (+ bias) for W = q [N, K] int8 · scales [N] float32: [M, N] float32."""
    k = x.shape[1]
    if _by_kind_here() and k % 32 == 0:
        return _by_kind(
            x,
            q.shape[0],
            lambda part, prompt, out: _q8(part, q, scales, bias, _prompt_path(k) if prompt else None, out),
        )
    return _q8(x, q, scales, bias, None)


def _q8(x, q, scales, bias, path: int | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`q8_linear` by `path` (None: `q8_path`'s for x's row count), into `out` when given."""
    rows, k = x.shape
    n = q.shape[0]
    x = x.contiguous()
    y = torch.empty(rows, n, dtype=torch.float32) if out is None else out
    args = (x.data_ptr(), k, rows, k, q.data_ptr(), scales.data_ptr(), n, _ptr(bias), y.data_ptr(), n)
    path = q8_path(rows, k) if path is None else path
    if path >= 0:
        status = library().kettle_q8_linear_rows(*args, path, torch.get_num_threads())
    else:
        entry = library().kettle_q8_linear_qa if path == Q8_QUANTIZED else library().kettle_q8_linear
        status = entry(*args, torch.get_num_threads())
    if status:
        raise MemoryError("CPU kernel: out of memory for the activations or weight rows")
    return y


def q8g_linear(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, lanes: bool = False
) -> torch.Tensor:
    """x [M, K] float32 · Wᵀ (+ bias) for GGUF's Q8_0 layout, W = q [N, K] int8 · scales [N, K/32] float16 per
    block (in lanes when `lanes`: kettle/quantization/q8.py): quantized activations below Q8_FLOAT_ROWS rows (or
    none with KETTLE_QUANTIZED_ACTIVATIONS=0), the float32 tiles above, the panels from `panel_rows()` rows; under
    batch invariance by `q8g_path`, and in rows by the kind of row (`row_kinds`). [M, N] float32."""
    k = x.shape[1]
    if _by_kind_here(lanes):
        return _by_kind(
            x,
            q.shape[0],
            lambda part, prompt, out: _q8g(part, q, scales, bias, lanes, 1 + _prompt_path(k) if prompt else None, out),
        )
    return _q8g(x, q, scales, bias, lanes, None)


def _q8g(x, q, scales, bias, lanes: bool, path: int | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`q8g_linear` by `path` (None: `q8g_path`'s for x's row count), into `out` when given."""
    rows, k = x.shape
    n = q.shape[0]
    x = x.contiguous()
    y = torch.empty(rows, n, dtype=torch.float32) if out is None else out
    status = library().kettle_q8g_linear(
        x.data_ptr(), k, rows, k, q.data_ptr(), scales.data_ptr(), n, lanes, _ptr(bias), y.data_ptr(), n,
        q8g_path(rows, k, lanes) if path is None else path, torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise MemoryError("CPU kernel: out of memory for the activations or weight rows")
    return y


# `q8_path`'s codes for the one-pass entries (its paths 0-2 are `kettle_q8_linear_rows`' own).
Q8_QUANTIZED, Q8_PLAIN = -1, -2


def q8_path(rows: int, k: int) -> int:
    """`q8_linear`'s entry for `rows` rows of K inputs: `kettle_q8_linear_rows` with the path returned (0-2) from
    the float32 tiles' or the panels' row count on (the decode step's choice), else Q8_QUANTIZED
    (`kettle_q8_linear_qa`: int16 activations) or Q8_PLAIN (`kettle_q8_linear`). decoder_step.c's greedy
    steps run an int8 LM head by the same codes. Under batch invariance each row as alone (ROWS_INVARIANT; with
    float32 rows, or K not whole blocks, Q8_PLAIN, whose rows keep their own chains at any count)."""
    if batch_invariant():
        return ROWS_INVARIANT if QUANTIZED_ACTIVATIONS and k % 32 == 0 else Q8_PLAIN
    if rows >= min(Q8_FLOAT_ROWS, panel_rows()):
        return _rows_path(rows, k)
    return Q8_QUANTIZED if QUANTIZED_ACTIVATIONS and k % 32 == 0 else Q8_PLAIN


def q8g_path(rows: int, k: int, lanes: bool = False) -> int:
    """`kettle_q8g_linear`'s path for `rows` rows of K inputs: 0 float32 tiles, 1 quantized activations, 2 the
    float32 panels, 3 the integer panels, 4 each row as alone (in rows, under batch invariance). A weight in lanes
    keeps quantized rows below the panels."""
    if batch_invariant():
        if not QUANTIZED_ACTIVATIONS:  # the tiles: each row's own chains over the dequantized weight
            return 0
        if lanes:
            return 1 + ROWS_INT_GEMM if _lanes_invariant(rows) else 1
        return 4
    if rows >= panel_rows(lanes):
        return 1 + _rows_path(rows, k, lanes)
    return int(QUANTIZED_ACTIVATIONS and (lanes or rows < Q8_FLOAT_ROWS))


def q8g_rows(q: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, lanes: bool = False) -> torch.Tensor:
    """Rows `ids` of a Q8_0 weight (q [N, K] int8, scales [N, K/32] float16; in lanes when `lanes`) as float32
    [len(ids), K]."""
    ids = _row_ids(ids, q.shape[0])
    out = torch.empty(ids.numel(), q.shape[1], dtype=torch.float32)
    library().kettle_q8g_rows(
        q.data_ptr(), scales.data_ptr(), q.shape[0], q.shape[1], lanes, ids.data_ptr(), ids.numel(), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def _row_ids(ids: torch.Tensor, rows: int) -> torch.Tensor:
    """`ids` flat as int64, each checked to name one of `rows` rows: an id past the table (a tokenizer's added
    token the model has no row for) fails its batch as PyTorch's embedding would, instead of reading past it."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    if ids.numel():
        low, high = (int(v) for v in torch.aminmax(ids))  # one pass over the step's ids
        if low < 0 or high >= rows:
            raise IndexError(f"token ids must be in [0, {rows}): got {low}..{high}")
    return ids


def q4_rows(
    packed: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group_size: int,
    ids: torch.Tensor,
    lanes: bool = False,
    supers: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows `ids` of a Q4 weight (`q4_linear`'s layouts) as float32 [len(ids), K], the values its kernels multiply."""
    ids = _row_ids(ids, packed.shape[0])
    k = packed.shape[1] * 2
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    library().kettle_q4_rows(
        packed.data_ptr(), scales.data_ptr(), _ptr(mins), packed.shape[0], k, group_size, lanes, _ptr(supers),
        ids.data_ptr(), ids.numel(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Decode attention over the paged cache read in place: q [S, H, D] float32, caches [slots, Hkv, D] of a
    `KV_DTYPES` type, tables [S, max_blocks] int64, positions [S] int64 of the new tokens (context = position + 1)
    → [S, H, D] float32."""
    seqs, heads, dim = q.shape
    q, tables, positions = q.contiguous(), tables.contiguous(), positions.contiguous()
    out = torch.empty_like(q)
    status = library().kettle_paged_decode(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1], positions.data_ptr(),
        seqs, heads, k_cache.shape[1], dim, block_size, scale, window or 0, out.data_ptr(), KV_DTYPES[k_cache.dtype],
        batch_invariant(), torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise MemoryError("CPU kernel: out of memory for the attention scores")
    return out


def kv_fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the attention kernels take these: float32 queries (or new K/V rows) and contiguous CPU caches of one
    `KV_DTYPES` type (as KVCache allocates them), kernels built and on."""
    return (
        fits(q)
        and k_cache.dtype == v_cache.dtype
        and k_cache.dtype in KV_DTYPES
        and k_cache.device.type == v_cache.device.type == "cpu"
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )


def cache_write_fits(k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether `cache_write` takes these: float32 new rows, each token's heads packed in its row (views of the
    fused qkv output are fine), caches as `kv_fits` wants them."""
    rows_packed = all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (k_new, v_new))
    return fits(v_new) and kv_fits(k_new, k_cache, v_cache) and rows_packed


def cache_write(
    k_new: torch.Tensor, v_new: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> None:
    """k_cache[slots] = k_new and v_cache[slots] = v_new (k_new/v_new [T, Hkv, D] float32, caches [slots, Hkv, D]
    of a `KV_DTYPES` type: 16-bit caches get the rows rounded to nearest-even, as `.to(dtype)` rounds them)."""
    tokens, heads, dim = k_new.shape
    slots = slots.contiguous()
    library().kettle_cache_write(
        k_new.data_ptr(), k_new.stride(0), v_new.data_ptr(), v_new.stride(0), slots.data_ptr(), tokens, heads * dim,
        k_cache.data_ptr(), v_cache.data_ptr(), KV_DTYPES[k_cache.dtype], torch.get_num_threads(),
    )  # fmt: skip


def paged_prefill_fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int) -> bool:
    """Whether `paged_prefill` takes these: float32 queries with the heads of each row packed (a view of the fused
    qkv output is fine), caches as `kv_fits` wants them, head size a multiple of 8, blocks a multiple of 16 slots."""
    dim = q.shape[-1]
    return (
        kv_fits(q, k_cache, v_cache)
        and q.stride(-1) == 1
        and q.stride(-2) == dim
        and dim % 8 == 0
        and block_size % 16 == 0
    )


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    cache_len: int,
    block_size: int,
    scale: float,
    window: int | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over its paged context, read in place (their K/V already
    written): q [L, H, D] at positions cache_len .., caches [slots, Hkv, D] of a `KV_DTYPES` type, table [blocks]
    int64 → [L, H, D],
    written into `out` when given (contiguous, e.g. the sequence's rows of the whole step's output)."""
    tokens, heads, dim = q.shape
    table = table.contiguous()
    out = torch.empty(tokens, heads, dim, dtype=torch.float32) if out is None else out
    status = library().kettle_paged_prefill(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), tokens, cache_len,
        heads, k_cache.shape[1], dim, block_size, scale, window or 0, out.data_ptr(), KV_DTYPES[k_cache.dtype],
        torch.get_num_threads(),
    )  # fmt: skip
    if status:
        raise MemoryError("CPU kernel: out of memory for the attention tiles")
    return out


def fits(*tensors: torch.Tensor) -> bool:
    """Whether the element-wise CPU kernels take these tensors: float32 on the CPU, kernels built and on."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and available()


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(RMSNorm(x or residual + x) · weight, residual + x or None), over the last dimension."""
    dim = x.shape[-1]
    x = x.contiguous()
    out = torch.empty_like(x)
    total = None if residual is None else torch.empty_like(x)
    library().kettle_rms_norm(
        x.data_ptr(), _ptr(None if residual is None else residual.contiguous()), weight.data_ptr(), x.numel() // dim,
        dim, eps, out.data_ptr(), _ptr(total), torch.get_num_threads(),
    )  # fmt: skip
    return out, total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up for gate_up [..., 2I] holding gate then up: [..., I]."""
    return _gated(library().kettle_silu_mul, gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") · up for gate_up [..., 2I] holding gate then up: [..., I]."""
    return _gated(library().kettle_gelu_tanh_mul, gate_up)


def _gated(kernel, gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = gate_up.contiguous()
    inner = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inner)
    kernel(gate_up.data_ptr(), gate_up.numel() // (2 * inner), inner, out.data_ptr(), torch.get_num_threads())
    return out


def rope_fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """x [T, heads, D] with heads packed in each row (a view of the fused qkv output is fine), cos/sin
    [T, 1, D] contiguous: the layout `rope` reads."""
    dim = x.shape[-1]
    return (
        fits(x, cos, sin)
        and x.stride(-1) == 1
        and x.stride(-2) == dim
        and cos.shape[-1] == sin.shape[-1] == dim
        and cos.is_contiguous()
        and sin.is_contiguous()
    )


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x · cos + swap_halves(x) · sin (sin signed) for x [T, heads, D]: a new contiguous tensor."""
    rows, heads, dim = x.shape
    out = torch.empty(rows, heads, dim, dtype=x.dtype)
    library().kettle_rope(
        x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), rows, heads, dim, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def greedy_fits(scores: torch.Tensor) -> bool:
    """Whether `greedy` takes these scores: float32 [B, V] on the CPU with contiguous rows, kernels on."""
    return scores.dim() == 2 and scores.stride(1) == 1 and fits(scores)


def greedy(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For scores [B, V] float32 (rows contiguous): each row's first maximum (as `argmax` picks it) [B] int64 and
    its log-softmax value [B] float32, without the [B, V] log-softmax."""
    rows, vocab = scores.shape
    ids = torch.empty(rows, dtype=torch.long)
    logprobs = torch.empty(rows, dtype=torch.float32)
    library().kettle_greedy(
        scores.data_ptr(), rows, vocab, scores.stride(0), ids.data_ptr(), logprobs.data_ptr(), torch.get_num_threads()
    )
    return ids, logprobs
