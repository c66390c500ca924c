"""Paged attention: the per-step token layout (`AttentionMetadata`) and the backend that attends over it.

One forward covers many sequences, their new tokens concatenated in one flat [T] layout. Sequence i brings
`query_lens[i]` new tokens at positions `cache_lens[i] ..`; the K/V of its earlier positions are already in
the paged cache (a shared prefix, an earlier prefill chunk, or earlier decode steps). Everything that depends
only on that layout (slots, positions, gather indices, masks) is built once per step in `build` and reused by
every layer, so a layer costs one cache write plus the attention kernels.

Sequences with one new token (decodes) are attended together in one batched call; the others (prefills,
whole or chunked) one call each. The kernels live behind `AttentionBackend`, chosen by `KETTLE_TUNING=attention=`.

A prefill may hold spans of positions whose tokens attend to each other both ways (Gemma 3's image tokens:
`attend_both_ways`); its mask then un-masks each span, and only such a prefill leaves the causal kernels for a
masked one. The span must lie whole within the sequence's context once the step's tokens are in (the scheduler
never ends a chunk inside one); its part before the chunk is in the cache, already visible causally.
"""

from __future__ import annotations

import importlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from typing import Protocol

import torch

from kettle import settings


def window_mask(
    query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None, spans: Sequence[tuple[int, int]] = ()
) -> torch.Tensor:
    """Boolean mask (True = attend): causal, and within the last `window` positions when one is set; within each
    of `spans` ([start, end) positions) every query also sees the span's later keys.

    The window matches Hugging Face's sliding attention: a query at p sees keys at p - window + 1 .. p; a span
    is Hugging Face's bidirectional block (its `blockwise_overlay`), OR-ed with the causal mask before the
    window's lower bound applies.
    """
    mask = key_pos <= query_pos
    for start, end in spans:
        mask = mask | ((query_pos >= start) & (query_pos < end) & (key_pos >= start) & (key_pos < end))
    if window is not None:
        mask &= key_pos > query_pos - window
    return mask


class _WindowMasks:
    """Plans with `query_positions`, `key_positions` and a `masks` dict: one mask per window size per step."""

    spans: Sequence[tuple[int, int]] = ()  # positions attended both ways (a prefill's; never a decode's)

    def mask(self, window: int | None) -> torch.Tensor:
        """The boolean mask (decode: [Nd, 1, 1, L]; prefill: [L, context]), built on first use in a step."""
        if window not in self.masks:
            self.masks[window] = window_mask(self.query_positions, self.key_positions, window, self.spans)
        return self.masks[window]


@dataclass
class DecodePlan(_WindowMasks):
    """The sequences with one new token, attended together over a padded gather of their cached blocks."""

    token_range: tuple[int, int] | None  # where their tokens sit in T when contiguous (the common case)
    token_indices: torch.Tensor | None  # [Nd] their indices in T, when not contiguous
    block_ids: torch.Tensor  # [Nd * max_blocks] block tables, padded with block 0 (masked out)
    num_blocks: int  # max_blocks: blocks gathered per sequence
    query_positions: torch.Tensor  # [Nd, 1, 1, 1]
    key_positions: torch.Tensor  # [1, 1, 1, max_blocks * block_size]
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)


@dataclass
class PrefillPlan(_WindowMasks):
    """One sequence with several new tokens: tokens start..end of T, positions cache_len onwards."""

    start: int
    end: int
    cache_len: int
    block_ids: torch.Tensor  # its blocks covering the whole context (new tokens included)
    query_positions: torch.Tensor  # [L, 1]
    key_positions: torch.Tensor  # [1, context] (context = cache_len + L)
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) positions attended both ways

    def needs_mask(self, window: int | None) -> bool:
        """Whether plain causal attention over the new tokens alone would be wrong."""
        return self.cache_len > 0 or bool(self.spans) or (window is not None and self.end - self.start > window)


@dataclass
class PrefillBatch:
    """A step's prefills side by side: prefill i's `query_lens[i]` tokens start at `starts[i]` in T, at positions
    `cache_lens[i]` onwards, over block table row i (padded with block 0 past its own blocks)."""

    starts: torch.Tensor  # [P] int32
    query_lens: torch.Tensor  # [P] int32
    cache_lens: torch.Tensor  # [P] int32
    tables: torch.Tensor  # [P, max blocks] int64
    max_query_len: int


@dataclass
class AttentionMetadata:
    """The flat token layout of one forward, shared by every layer."""

    slots: torch.Tensor  # [T] cache slot of each new token
    positions: torch.Tensor  # [T]
    last_token_indices: torch.Tensor  # [num_seqs] index in T of each sequence's last new token
    query_lens: list[int]
    cache_lens: list[int]
    block_size: int
    max_seq_len: int  # longest context this step (cache + new), for RoPE tables
    decode: DecodePlan | None
    prefills: list[PrefillPlan]
    # Some sequences are rows of one request at consecutive positions (speculation's verification, see
    # kettle/shard/speculation.py): a row attends to K/V that another row of the step writes. Kernels that write a
    # row's K/V in the same launch as other rows read them (the CUDA decode kernel) must then write first.
    chained: bool = False
    _prefill_batch: PrefillBatch | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.slots.shape[0])

    @property
    def decode_only(self) -> bool:
        """Every token is a decode, in T order: the decode plan's output is the whole output."""
        return not self.prefills and self.decode is not None and self.decode.token_range == (0, self.num_tokens)

    @property
    def prompt_ranges(self) -> list[tuple[int, int]]:
        """The [start, end) ranges in T of the prefills' tokens (every other token is a decode row)."""
        return [(plan.start, plan.end) for plan in self.prefills]

    def attend_both_ways(self, flagged: torch.Tensor) -> None:
        """Marks each run of consecutive `flagged` tokens ([T] bool) within one prefill's new tokens as a span
        attended both ways (`window_mask`), as Hugging Face's token types mark an image's tokens. A run at the
        start of a chunk may continue an image whose first tokens are cached: those are visible causally anyway,
        so the span's part in the chunk gives the same mask."""
        flags = flagged.tolist() if self.prefills else []
        for plan in self.prefills:
            runs = _runs(flags[plan.start : plan.end])
            plan.spans = [(plan.cache_len + start, plan.cache_len + end) for start, end in runs if end - start > 1]
            plan.masks.clear()

    def prefill_batch(self) -> PrefillBatch:
        """Every prefill as one varlen batch, for kernels that attend them all in one launch; built on first use
        in a step (one host-to-device copy, one padding of the block tables) and shared by every layer."""
        if self._prefill_batch is None:
            plans = self.prefills
            device = self.positions.device
            fields = long_tensor(
                [p.start for p in plans] + [p.end - p.start for p in plans] + [p.cache_len for p in plans]
            )
            starts, query_lens, cache_lens = fields.to(device, torch.int32).view(3, len(plans))
            tables = torch.nn.utils.rnn.pad_sequence([p.block_ids for p in plans], batch_first=True)
            longest = max(p.end - p.start for p in plans)
            self._prefill_batch = PrefillBatch(starts, query_lens, cache_lens, tables, longest)
        return self._prefill_batch

    def seq_lens_per_token(self) -> torch.Tensor:
        """[T] the context length (cache + new) of each token's sequence (dynamic-NTK RoPE needs it)."""
        totals = [c + q for c, q in zip(self.cache_lens, self.query_lens, strict=True)]
        counts = torch.tensor(self.query_lens, device=self.positions.device)
        return torch.tensor(totals, device=self.positions.device).repeat_interleave(counts)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        cache_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
        prompts: list[bool] | None = None,
        chained: bool = False,
    ) -> AttentionMetadata:
        """Computes slots, positions and the attention plans for one step on the host, then moves them once.
        `prompts`: which sequences bring prompt tokens; one that brings a single one is then a prefill too (by
        default a single new token is a decode), so a prompt token is attended by the prefill kernel however its
        prompt was chunked or cached (batch invariance: kettle/kernels/ops.py). `chained`: some sequences read
        K/V that others write in this step (the `chained` field)."""
        if not query_lens or min(query_lens) < 1:
            raise ValueError(f"every sequence in a step needs at least one new token, got {query_lens}")
        prompts = prompts or [False] * len(query_lens)
        seq_lens = [c + q for c, q in zip(cache_lens, query_lens, strict=True)]
        tables = _padded_tables(block_tables, seq_lens, block_size)
        starts = list(accumulate(query_lens, initial=0))
        positions, slots = _token_layout(query_lens, cache_lens, starts, block_tables, tables, block_size)
        device = torch.device(device)
        return cls(
            slots=slots.to(device),
            positions=positions.to(device),
            last_token_indices=long_tensor(starts[1:]).sub_(1).to(device),
            query_lens=list(query_lens),
            cache_lens=list(cache_lens),
            block_size=block_size,
            max_seq_len=max(seq_lens),
            decode=_decode_plan(query_lens, seq_lens, starts, tables, block_size, device, prompts),
            prefills=[
                _prefill_plan(starts[i], query_lens[i], cache_lens[i], tables[i], block_size, device)
                for i in range(len(query_lens))
                if query_lens[i] > 1 or prompts[i]
            ],
            chained=chained,
        )


def _runs(flags: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each run of True in `flags`."""
    runs: list[tuple[int, int]] = []
    for i, flag in enumerate(flags):
        if flag and runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        elif flag:
            runs.append((i, i + 1))
    return runs


def long_tensor(values: Iterable[int]) -> torch.Tensor:
    """A CPU int64 tensor from Python ints, ~7x faster than torch.tensor(list) (which converts one by one)."""
    buffer = array("q", values)
    return torch.frombuffer(buffer, dtype=torch.long) if buffer else torch.empty(0, dtype=torch.long)


def _token_layout(
    query_lens: list[int],
    cache_lens: list[int],
    starts: list[int],
    block_tables: list[list[int]],
    tables: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position and cache slot of every new token: per sequence in a pure decode step, else tensor ops."""
    if starts[-1] == len(query_lens):
        # One token per sequence: its position is the cache length; one lookup per sequence, not per token.
        pairs = zip(block_tables, cache_lens, strict=True)
        return long_tensor(cache_lens), long_tensor(t[c // block_size] * block_size + c % block_size for t, c in pairs)
    counts = long_tensor(query_lens)
    seq_of_token = torch.arange(len(query_lens)).repeat_interleave(counts)
    offsets = long_tensor(cache_lens) - long_tensor(starts[:-1])
    positions = torch.arange(starts[-1]) + offsets[seq_of_token]
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    return positions, slots


def _padded_tables(block_tables: list[list[int]], seq_lens: list[int], block_size: int) -> torch.Tensor:
    """[S, max blocks needed] block ids; short rows are padded with block 0, whose slots are always masked out."""
    width = -(-max(seq_lens) // block_size)
    flat = array("q")
    for table, seq_len in zip(block_tables, seq_lens, strict=True):
        if len(table) * block_size < seq_len:
            raise ValueError(f"a block table of {len(table)} blocks cannot hold {seq_len} tokens")
        flat.extend(table[:width])
        flat.extend(repeat(0, width - len(table)))
    return torch.frombuffer(flat, dtype=torch.long).view(len(block_tables), width)


def _decode_plan(
    query_lens: list[int],
    seq_lens: list[int],
    starts: list[int],
    tables: torch.Tensor,
    block_size: int,
    device,
    prompts: list[bool],
) -> DecodePlan | None:
    """Groups every one-token sequence (but a prompt's) into one padded batch over their block tables."""
    seqs = [i for i, q in enumerate(query_lens) if q == 1 and not prompts[i]]
    if not seqs:
        return None
    token_starts = [starts[i] for i in seqs]
    contiguous = token_starts[-1] - token_starts[0] == len(seqs) - 1
    num_blocks = -(-max(seq_lens[i] for i in seqs) // block_size)
    rows = tables if len(seqs) == len(query_lens) else tables[long_tensor(seqs)]
    return DecodePlan(
        token_range=(token_starts[0], token_starts[-1] + 1) if contiguous else None,
        token_indices=None if contiguous else long_tensor(token_starts).to(device),
        block_ids=rows[:, :num_blocks].reshape(-1).to(device),
        num_blocks=num_blocks,
        query_positions=long_tensor(seq_lens[i] - 1 for i in seqs).view(-1, 1, 1, 1).to(device),
        key_positions=torch.arange(num_blocks * block_size, device=device).view(1, 1, 1, -1),
    )


def _prefill_plan(
    start: int, query_len: int, cache_len: int, table: torch.Tensor, block_size: int, device
) -> PrefillPlan:
    """One sequence's prefill: over its new K/V alone when nothing is cached, else over its gathered blocks."""
    seq_len = cache_len + query_len
    num_blocks = -(-seq_len // block_size)
    # With a cached prefix, keys come from a block-aligned gather; otherwise from the new tokens themselves.
    num_keys = num_blocks * block_size if cache_len else query_len
    return PrefillPlan(
        start=start,
        end=start + query_len,
        cache_len=cache_len,
        block_ids=table[:num_blocks].to(device),
        query_positions=torch.arange(cache_len, seq_len, device=device).view(-1, 1),
        key_positions=torch.arange(num_keys, device=device).view(1, -1),
    )


class AttentionBackend(Protocol):
    """Writes a layer's new K/V into the paged cache and attends. CUDA kernels implement the same call."""

    name: str

    def forward(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        alibi_slopes: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor: ...


# Backend name → "module:class", imported on first use so CPU installs never import GPU code.
BACKENDS = {
    "sdpa": "kettle.layers.sdpa_attention:SdpaBackend",
    "cuda": "kettle.layers.cuda_attention:CudaBackend",
}
_loaded: dict[str, AttentionBackend] = {}


def get_backend(name: str | None = None, device_type: str = "cpu") -> AttentionBackend:
    """The backend named by `name` or `KETTLE_TUNING=attention=`; by default "cuda" for CUDA tensors, else "sdpa"."""
    name = name or settings.current().attention_backend or ("cuda" if device_type == "cuda" else "sdpa")
    if name not in _loaded:
        if name not in BACKENDS:
            known = ", ".join(BACKENDS)
            raise ValueError(f"unknown attention backend {name!r} (KETTLE_TUNING=attention=); available: {known}")
        module, cls = BACKENDS[name].split(":")
        _loaded[name] = getattr(importlib.import_module(module), cls)()
    return _loaded[name]


def paged_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float | None = None,
    backend: AttentionBackend | None = None,
) -> torch.Tensor:
    """q [T, H, D], k_new/v_new [T, Hkv, D], caches [slots, Hkv, D] → [T, H, D]; writes k_new/v_new first.
    `backend`: the one the caller chose once (`Attention` keeps it), else the default for q's device.

    Optional score modifiers (both cost nothing when None, the Llama path):
    - `alibi_slopes` [H] float32: ALiBi (BLOOM, MPT, Falcon-alibi), slope_h · (key_pos - query_pos) added to
      the scaled scores; this differs from Hugging Face's slope_h · key_pos by a per-row constant, which
      softmax ignores, and keeps the bias small (≤ 0 where attended).
    - `softcap`: Gemma 2's logit soft-capping, scores → softcap · tanh(scores / softcap) before masking.
    """
    backend = backend or get_backend(device_type=q.device.type)
    if alibi_slopes is None and softcap is None:
        return backend.forward(q, k_new, v_new, k_cache, v_cache, meta, scale, sliding_window)
    return backend.forward(q, k_new, v_new, k_cache, v_cache, meta, scale, sliding_window, alibi_slopes, softcap)
