"""Tensor-level calls into Kettle's CPU kernels (the C files of this folder), one ctypes call each.

Callers check `available()` (or `fits`, which also checks device and dtype; the build is cached, so a check is a
dictionary lookup) and keep PyTorch's ops as the other path. The wrappers take float32 tensors, write into a
fresh output tensor, and pass PyTorch's thread count to the kernels' parallel loops. The attention kernels also
take a KV cache in float16 or bfloat16 (`--kv-cache-dtype`): they widen its rows as they read them and round
the new rows to nearest-even as they write them; their math stays float32.

Every projection is `linear(x, weight)`, whatever its weight type: the C side picks the path for the row count,
the CPU and the tuning (kettle/kernels/linear.c `choose_path`), the same rule the fused decode step follows. The
tuning is read from kettle/settings.py at each call (`tuning()`), so a test sets `KETTLE_TUNING` and reloads the
settings. By default each row keeps one arithmetic whatever the step's row count (`batch_invariant`), and the
paths only pick between kernels of the same bits.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kettle import settings
from kettle.kernels.build import library
from kettle.kernels.structs import (
    AVX2_LANES_TYPES,
    LANES_TYPES,
    PATH_DECODE_ROWS,
    PATH_PROMPT_ROWS,
    PATHS,
    ROWS_GELU_TANH_MUL,
    ROWS_GREEDY,
    ROWS_RMS_NORM,
    ROWS_ROPE,
    ROWS_SILU_MUL,
    WEIGHT_TYPES,
    Attention,
    Linear,
    Tuning,
    outputs,
)

# Activation rows the rows layouts' one-pass kernels take in one pass over the weights (kernels.h's MAX_TILE): a
# fifth row starts a second pass, which unpacks every weight again (the fused step on the bundled model at context
# 560: 4 rows 2.30x a one-row step, 5 rows 3.01x; kettle/shard/speculation.py sizes its verification steps by it).
# The row counts from which the float32 tiles and the panels take over are higher (linear.c).
TILE_ROWS = 4
# The same for weights in lanes (kernels.h's LANES_TILE: 8 rows of 16 channels' accumulators in AVX-512's 32
# registers; the panels take over from 128 rows). On the bundled model a speculative step of 5 rows (`--speculate
# 4`'s 4 drafts) then copied 2.06x against 1.60x at 4 rows (2026-11-27, `python -m bench speculation --in-process`).
LANES_TILE_ROWS = 8

# The KV cache element types the attention kernels read and write, by their code in kernels.h (KV_F32, ...).
KV_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def available() -> bool:
    """True when the kernels are built and switched on (`KETTLE_TUNING=cpu-kernels=off` turns them off)."""
    return library() is not None


def batch_invariant() -> bool:
    """Whether each row of a step is computed exactly as that row alone would be, whatever else shares the step
    (on by default; `KETTLE_TUNING=batch-invariant=off`; read at each call): the same request then gives the same
    tokens alone and in any batch. The projections pick their kernels so (linear.c), the decode attention cuts each
    context as it would cut it alone (`paged_decode`), and kettle/kernels/weight_types.c says how a row's arithmetic
    is fixed."""
    return settings.current().batch_invariant


def quantized_activations() -> bool:
    """Whether the quantized projections read quantized rows (per block of 32 for integer dot products: int8 for
    weights in lanes and the integer panels, int16 for the rows layouts; faster than dequantizing every weight to
    float) rather than float32 rows, exact to the dequantized weights (`KETTLE_TUNING=quantized-activations=off`)."""
    return settings.current().quantized_activations


def prefill_attention() -> bool:
    """Whether prefill attention runs on Kettle's kernel (`KETTLE_TUNING=prefill-attention=off`: SDPA's)."""
    return settings.current().cpu_prefill_attention


def tuning() -> Tuning:
    """The chooser's switches from this process's settings (one struct per settings object: read at call time)."""
    return _tuning(settings.current())


@functools.cache
def _tuning(current: settings.Settings) -> Tuning:
    def rows(value: int | None) -> int:
        return -1 if value is None else value

    flags = (current.quantized_activations, current.batch_invariant, current.cpu_integer_gemm)
    return Tuning(*map(int, flags), rows(current.cpu_float_rows), rows(current.cpu_gemm_rows))


def vnni() -> bool:
    """Whether this CPU has what the lanes layouts and the integer panels need (AVX-512 with VNNI, BW and VL)."""
    return bool(ctypes.c_int.in_dll(library(), "kettle_cpu_vnni512").value)


def lanes(kind: int | None = None) -> bool:
    """Whether weights (with a multiple of 16 output channels) are stored in lanes here (kernels.h's layouts, not
    switched off by `KETTLE_TUNING=lanes=off`): every lanes type where the CPU has AVX-512 VNNI; with `kind`, whether
    that type is, which the types with AVX2 tiles (`AVX2_LANES_TYPES`) are on any CPU the kernels run on."""
    if not (available() and settings.current().cpu_lanes):
        return False
    return vnni() or kind in AVX2_LANES_TYPES


def integer_gemm(kind: int | None = None) -> bool:
    """Whether the panels are the integer ones (switched on, over int8 rows): for every type where the CPU has AVX-512
    VNNI; with `kind`, whether they are for that type, which the lanes types with AVX2 tiles (`AVX2_LANES_TYPES`, the
    integer panels' AVX2 micro-kernel) are on any CPU the kernels run on (linear.c's `integer_panels`)."""
    current = settings.current()
    if not (available() and current.cpu_integer_gemm and current.quantized_activations):
        return False
    return vnni() or kind in AVX2_LANES_TYPES


def path(weight: Linear, rows: int, prompt: bool = False) -> str:
    """The path `linear` takes for `weight` at `rows` rows (prompt rows: `prompt`), as linear.c names it in kernels.h:
    plain, tiles, quantized, invariant, gemm or int_gemm."""
    how = PATH_PROMPT_ROWS if prompt else PATH_DECODE_ROWS
    return PATHS[library().kettle_linear(ctypes.byref(weight), None, 0, rows, None, 0, how, ctypes.byref(tuning()), 1)]


def weight_type(weight: Linear) -> str:
    """The weight's row in the C table (weight_types.c): q4, q8, f32, q8_0, q4_lanes, q8_0_lanes or q6_k_lanes."""
    return WEIGHT_TYPES[weight.kind]


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
    and decode rows a row's arithmetic alone (the invariant path), so a prompt keeps its GEMM's speed and a decode row
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


def _by_kind(x: torch.Tensor, n: int, kinds: RowKinds, run: Run) -> torch.Tensor:
    """run(rows, prompt, out) over x's prompt rows (prompt True) and its decode rows, each kind in one call, into
    one [M, N] output. A kind whose rows are one run (the usual step: its sequences' tokens side by side) is read and
    written in place (`out`: its rows of the output), else gathered and scattered."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    for rows, span, prompt in ((kinds.prompt, kinds.spans[0], True), (kinds.decode, kinds.spans[1], False)):
        if span is not None:
            run(x[span[0] : span[1]], prompt, y[span[0] : span[1]])
        else:
            y.index_copy_(0, rows, run(x.index_select(0, rows), prompt, None))
    return y


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def linear(x: torch.Tensor, weight: Linear) -> torch.Tensor:
    """x [M, K] float32 · Wᵀ (+ bias) for a weight of any type (`weight`: its C description, kettle/quantization/
    kernel_weight.py): [M, N] float32. Within `row_kinds`, a weight whose prompt rows take another path than its
    decode rows (the rows layouts under batch invariance) runs each kind in its own call."""
    kinds = _ROW_KINDS.get()
    if kinds is None or kinds.count != x.shape[0] or not kinds.prompt.numel():
        return _linear(x, weight, PATH_DECODE_ROWS)
    if not kinds.decode.numel():
        return _linear(x, weight, PATH_PROMPT_ROWS)
    if path(weight, 1, prompt=True) == path(weight, 1):
        return _linear(x, weight, PATH_DECODE_ROWS)
    return _by_kind(x, outputs(weight), kinds, lambda part, prompt, out: _linear(part, weight, _how(prompt), out))


def _how(prompt: bool) -> int:
    return PATH_PROMPT_ROWS if prompt else PATH_DECODE_ROWS


def _linear(x: torch.Tensor, weight: Linear, how: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` on `how` (a path, or the chooser's for decode or prompt rows), into `out` when given ([M, N]
    contiguous)."""
    rows, k = x.shape
    n = outputs(weight)
    x = x.contiguous()
    y = torch.empty(rows, n, dtype=torch.float32) if out is None else out
    threads = torch.get_num_threads()
    status = library().kettle_linear(
        ctypes.byref(weight), x.data_ptr(), k, rows, y.data_ptr(), n, how, ctypes.byref(tuning()), threads
    )
    if status == -2:
        raise ValueError(f"CPU kernels: a {weight_type(weight)} weight has no {PATHS[how]} path")
    if status:
        raise MemoryError("CPU kernel: out of memory for the activations or weight rows")
    return y


def linear_on(x: torch.Tensor, weight: Linear, path_name: str) -> torch.Tensor:
    """`linear` on the named path, whatever the chooser would pick (the kernel tests' matrix, measurement)."""
    return _linear(x.contiguous(), weight, PATHS.index(path_name))


def dequantize(weight: Linear, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `ids` of W (every row when None) as float32 [len(ids), K], exactly the values the kernels multiply by
    (a per-channel scale applied): an embedding table's lookup, or the whole weight."""
    n = outputs(weight)
    ids = None if ids is None else _row_ids(ids, n)
    count = n if ids is None else ids.numel()
    out = torch.empty(count, weight.k, dtype=torch.float32)
    library().kettle_dequantize(ctypes.byref(weight), _ptr(ids), count, out.data_ptr(), torch.get_num_threads())
    return out


def pack(weight: Linear, source: int, blocks: np.ndarray, order: torch.Tensor | None = None) -> None:
    """Fills `weight`'s tensors (allocated in its layout) from a GGUF tensor's blocks (`source`: its
    GGMLQuantizationType; uint8 [rows, bytes a row], e.g. memory-mapped; row r of the weight is source row
    `order[r]`, order None: r), over all threads (kettle/kernels/gguf_pack.c). ValueError where the kernels have no
    packer from that type into the weight's."""
    data = np.ascontiguousarray(blocks)
    order = None if order is None else order.to(torch.int64).contiguous()
    status = library().kettle_pack(
        ctypes.byref(weight), source, data.ctypes.data, data.nbytes // len(data), _ptr(order), torch.get_num_threads()
    )
    if status:
        raise ValueError(f"CPU kernels: no packer from GGUF type {source} into a {weight_type(weight)} weight")


def _row_ids(ids: torch.Tensor, rows: int) -> torch.Tensor:
    """`ids` flat as int64, each checked to name one of `rows` rows: an id past the table (a tokenizer's added
    token the model has no row for) fails its batch as PyTorch's embedding would, instead of reading past it."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    if ids.numel():
        low, high = (int(v) for v in torch.aminmax(ids))  # one pass over the step's ids
        if low < 0 or high >= rows:
            raise IndexError(f"token ids must be in [0, {rows}): got {low}..{high}")
    return ids


def in_lanes(weight: Linear) -> bool:
    """Whether the weight's output channels are stored 16 at a time (its type's lanes layout)."""
    return weight.kind in LANES_TYPES


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
    call = Attention(0, q.data_ptr(), heads * dim, k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr())
    call.max_blocks, call.positions, call.rows = tables.shape[1], positions.data_ptr(), seqs
    _shape(call, heads, k_cache, dim, block_size, scale, window, out)
    call.per_sequence = batch_invariant()
    if library().kettle_attention(ctypes.byref(call), torch.get_num_threads()):
        raise MemoryError("CPU kernel: out of memory for the attention scores")
    return out


def _shape(
    call: Attention,
    heads: int,
    k_cache: torch.Tensor,
    dim: int,
    block_size: int,
    scale: float,
    window: int | None,
    out: torch.Tensor,
) -> None:
    """The fields decode and prefill attention share: heads, the cache's shape and type, scale, window, output."""
    call.heads, call.kv_heads, call.dim, call.block_size, call.window = (
        heads,
        k_cache.shape[1],
        dim,
        block_size,
        window or 0,
    )
    call.scale, call.kv_dtype, call.out = scale, KV_DTYPES[k_cache.dtype], out.data_ptr()


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
    call = Attention(1, q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr())
    call.max_blocks, call.rows, call.cache_len = table.numel(), tokens, cache_len
    _shape(call, heads, k_cache, dim, block_size, scale, window, out)
    if library().kettle_attention(ctypes.byref(call), torch.get_num_threads()):
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
    residual = None if residual is None else residual.contiguous()
    rows = x.numel() // dim
    _rows(ROWS_RMS_NORM, x, dim, _ptr(residual), weight.data_ptr(), rows, dim, 0, eps, out.data_ptr(), _ptr(total))
    return out, total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up for gate_up [..., 2I] holding gate then up: [..., I]."""
    return _gated(ROWS_SILU_MUL, gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") · up for gate_up [..., 2I] holding gate then up: [..., I]."""
    return _gated(ROWS_GELU_TANH_MUL, gate_up)


def _gated(op: int, gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = gate_up.contiguous()
    inner = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inner)
    _rows(op, gate_up, 2 * inner, None, None, gate_up.numel() // (2 * inner), inner, 0, 0.0, out.data_ptr(), None)
    return out


def _rows(op: int, x: torch.Tensor, ldx: int, a, b, rows: int, width: int, heads: int, eps: float, out, out2) -> None:
    """One `kettle_rows` call (cpu_kernels.c names each op's arguments)."""
    library().kettle_rows(op, x.data_ptr(), ldx, a, b, rows, width, heads, eps, out, out2, torch.get_num_threads())


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
    _rows(ROWS_ROPE, x, x.stride(0), cos.data_ptr(), sin.data_ptr(), rows, dim, heads, 0.0, out.data_ptr(), None)
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
    _rows(ROWS_GREEDY, scores, scores.stride(0), None, None, rows, vocab, 0, 0.0, ids.data_ptr(), logprobs.data_ptr())
    return ids, logprobs
