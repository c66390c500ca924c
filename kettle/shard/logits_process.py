"""Batched ("heterogeneous") logits processors: one small class per processing stage.

Each processor is built once per batch composition from the per-request parameters and touches only the rows
whose parameter is not neutral; a processor with no such row is not built at all (`build` returns None).
Processors run on float32 scores [B, V] and may modify them in place. The order they are applied in is the
sampler's business: watermark → repetition penalty → frequency penalty → presence penalty → (grammar mask) →
temperature → top-k → top-p → typical-p.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Self

import torch
from torch import Tensor

# Kirchenbauer et al.'s hash key: the previous token id times this seeds the green-list permutation.
WATERMARK_HASH_KEY = 15485863
NEG_INF = float("-inf")
# A host→GPU copy from pageable memory (`torch.tensor(values, device="cuda")`) waits for the whole stream: a
# tensor built after the step's forward was queued stalls the host until the forward ends. Copies from pinned
# memory, non-blocking, queue behind it instead.
ASYNC_H2D = True


def device_tensor(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)`, without a host sync on CUDA (see ASYNC_H2D).

    The pinned staging buffer stays reserved until the copy has run: PyTorch's caching host allocator records
    the copy's stream on it."""
    device = torch.device(device)
    if device.type != "cuda" or not ASYNC_H2D:
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass(frozen=True)
class StepInputs:
    """The per-step tensors some processors read besides the scores (None where the batch needs none)."""

    last_token_ids: Tensor  # [B] long: the token each row generated last (or the prompt's last token)
    history: Tensor | None = None  # [B, L] long: prompt + output ids, padded with -1
    history_lens: Tensor | None = None  # [B] long: real tokens per history row

    def take(self, index: Tensor | None) -> StepInputs:
        """The same inputs restricted to the rows in `index` (all rows when None)."""
        if index is None:
            return self
        tensors = (self.last_token_ids, self.history, self.history_lens)
        return StepInputs(*(None if t is None else t.index_select(0, index) for t in tensors))


class Rows:
    """The rows of a batch one processor acts on; when that is every row, no indexing is done."""

    def __init__(self, active: Sequence[bool], device: torch.device | str) -> None:
        positions = [i for i, on in enumerate(active) if on]
        self.count = len(positions)
        self.index = None if self.count == len(active) else device_tensor(positions, torch.long, device)

    def apply(self, scores: Tensor, step: StepInputs, fn: Callable[[Tensor, StepInputs], Tensor]) -> Tensor:
        """Runs `fn` on the active rows only and writes its result back into `scores`."""
        if self.index is None:
            return fn(scores, step)
        part = fn(scores.index_select(0, self.index), step.take(self.index))
        return scores.index_copy_(0, self.index, part)


class RowProcessor:
    """Base of the processors driven by one float parameter per row, with a neutral value that means "off"."""

    neutral: float = 1.0

    def __init__(self, values: Sequence[float], device: torch.device | str) -> None:
        active = [v != self.neutral for v in values]
        self.rows = Rows(active, device)
        kept = [self.transform(v) for v, on in zip(values, active, strict=True) if on]
        # Column vector so it broadcasts over the vocabulary.
        self.param = device_tensor(kept, torch.float32, device).unsqueeze(1)

    @classmethod
    def build(cls, values: Sequence[float], device: torch.device | str) -> Self | None:
        """The processor, or None when every row has the neutral value."""
        return cls(values, device) if any(v != cls.neutral for v in values) else None

    @staticmethod
    def transform(value: float) -> float:
        """The per-row value stored in `param` (computed in float64 before the float32 cast)."""
        return value

    def __call__(self, scores: Tensor, step: StepInputs) -> Tensor:
        return self.rows.apply(scores, step, self.process)

    def process(self, scores: Tensor, step: StepInputs) -> Tensor:
        raise NotImplementedError


def seen_columns(history: Tensor, width: int) -> Tensor:
    """History ids with padding (-1) and ids beyond the scores' width sent to a spare column `width`."""
    valid = (history >= 0) & (history < width)
    return history.masked_fill(~valid, width)


def history_targets(history: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """Columns to gather/scatter at for each history position, and whether that position is a real token.

    Padding must land somewhere without a spare column (which would cost a copy of the scores): it points at
    the row's first real token, so its write repeats that token's own, or at column 0 left as it was when the
    row has no real token. Duplicate targets therefore always carry identical values."""
    valid = (history >= 0) & (history < width)
    has_any = valid.any(dim=1, keepdim=True)
    anchor = history.gather(1, valid.int().argmax(dim=1, keepdim=True)).masked_fill(~has_any, 0)
    return torch.where(valid, history, anchor), valid | has_any


class RepetitionPenalty(RowProcessor):
    """Tokens already in prompt + output: negative scores × penalty, positive ÷ penalty (Keskar et al.).

    Works on the history positions only (gather, penalize, scatter back), not on the whole vocabulary."""

    def process(self, scores: Tensor, step: StepInputs) -> Tensor:
        columns, penalize = history_targets(step.history, scores.shape[-1])
        seen = scores.gather(1, columns)
        penalized = torch.where(seen < 0, seen * self.param, seen / self.param)
        return scores.scatter_(1, columns, torch.where(penalize, penalized, seen))


class FrequencyPenalty(RowProcessor):
    """Subtracts count / length × penalty, counts over prompt + output, length = the row's history length.

    Counts are summed as whole numbers first, so the result does not depend on the order of accumulation."""

    neutral = 0.0

    def process(self, scores: Tensor, step: StepInputs) -> Tensor:
        width = scores.shape[-1]
        columns = seen_columns(step.history, width)
        counts = torch.zeros(scores.shape[0], width + 1, dtype=scores.dtype, device=scores.device)
        counts.scatter_add_(1, columns, torch.ones_like(columns, dtype=scores.dtype))
        per_count = self.param / step.history_lens.clamp(min=1).to(scores.dtype).unsqueeze(1)
        return scores.addcmul_(counts[:, :width], per_count, value=-1.0)


class PresencePenalty(RowProcessor):
    """OpenAI's presence penalty: subtracts the penalty once from every token the row has *generated* (the
    prompt does not count), however many times it appeared."""

    neutral = 0.0

    def __init__(self, values: Sequence[float], prompt_lens: Sequence[int], device: torch.device | str) -> None:
        super().__init__(values, device)
        kept = [n for n, v in zip(prompt_lens, values, strict=True) if v != self.neutral]
        self.prompt_lens = device_tensor(kept, torch.long, device).unsqueeze(1)

    @classmethod
    def build(
        cls, values: Sequence[float], device: torch.device | str, prompt_lens: Sequence[int] | None = None
    ) -> Self | None:
        """The processor, or None when no row has a penalty; `prompt_lens` is needed when one has."""
        if all(v == cls.neutral for v in values):
            return None
        if prompt_lens is None:
            raise ValueError("a presence penalty needs the prompt lengths")
        return cls(values, prompt_lens, device)

    def process(self, scores: Tensor, step: StepInputs) -> Tensor:
        # `prompt_lens` holds the active rows only, in the order `Rows.apply` passes them.
        width = scores.shape[-1]
        positions = torch.arange(step.history.shape[1], device=scores.device).unsqueeze(0)
        generated = step.history.masked_fill(positions < self.prompt_lens, -1)
        present = torch.zeros(scores.shape[0], width + 1, dtype=scores.dtype, device=scores.device)
        present.scatter_(1, seen_columns(generated, width), 1.0)
        return scores.addcmul_(present[:, :width], self.param, value=-1.0)


class Temperature(RowProcessor):
    """Divides the scores by the row's temperature."""

    def process(self, scores: Tensor, step: StepInputs) -> Tensor:
        return scores.div_(self.param)


class TopK(RowProcessor):
    """Keeps the k highest scores of each row (ties with the k-th kept); k = 0 is off."""

    neutral = 0

    def __init__(self, values: Sequence[int], device: torch.device | str) -> None:
        super().__init__(values, device)
        ks = [int(k) for k in values if k != self.neutral]
        self.max_k = max(ks)
        self.kth = device_tensor(ks, torch.long, device).sub_(1).unsqueeze(1)

    def process(self, scores: Tensor, step: StepInputs) -> Tensor:
        width = scores.shape[-1]
        best = torch.topk(scores, min(self.max_k, width), dim=-1).values
        threshold = best.gather(1, self.kth.clamp(max=best.shape[-1] - 1))
        return scores.masked_fill_(scores < threshold, NEG_INF)


def drop_sorted(scores: Tensor, order: Tensor, remove_sorted: Tensor) -> Tensor:
    """Sets to -inf the entries of `scores` marked in `remove_sorted`, which is indexed in sorted order."""
    remove = torch.empty_like(remove_sorted).scatter_(1, order, remove_sorted)
    return scores.masked_fill_(remove, NEG_INF)


class TopP(RowProcessor):
    """Nucleus filtering: drops the least likely tokens whose total probability is at most 1 - top_p."""

    @staticmethod
    def transform(value: float) -> float:
        # The tail mass that may be cut; computed in float64 like a Python-scalar comparison would.
        return 1.0 - value

    def process(self, scores: Tensor, step: StepInputs) -> Tensor:
        ascending, order = torch.sort(scores, dim=-1)
        tail_mass = ascending.softmax(dim=-1).cumsum(dim=-1)
        remove = tail_mass <= self.param
        remove[:, -1] = False  # the most likely token always stays
        return drop_sorted(scores, order, remove)


class TypicalP(RowProcessor):
    """Locally typical filtering (Meister et al.): keeps the tokens whose surprise is closest to the entropy
    until their probability mass reaches typical_p."""

    def process(self, scores: Tensor, step: StepInputs) -> Tensor:
        logp = torch.log_softmax(scores, dim=-1)
        entropy = -(logp * logp.exp()).nansum(dim=-1, keepdim=True)
        distance, order = torch.sort((logp + entropy).abs(), dim=-1)
        mass = scores.gather(1, order).softmax(dim=-1).cumsum(dim=-1)
        # Index of the token that makes the kept mass reach typical_p.
        cutoff = (mass < self.param).sum(dim=-1, keepdim=True).clamp_(max=scores.shape[-1] - 1)
        remove = distance > distance.gather(1, cutoff)
        remove[:, 0] = False  # the most typical token always stays
        return drop_sorted(scores, order, remove)


class Watermark:
    """Kirchenbauer et al.'s green-list watermark: the previous token seeds a permutation of the vocabulary,
    whose first gamma × V tokens are "green" and get +delta.

    The permutation is drawn on the CPU, so the green list (and a detector's view of it) does not depend on the
    accelerator. Seeding needs the previous ids on the host: one small transfer per step, only for batches
    with a watermarked row.
    """

    def __init__(
        self, active: Sequence[bool], vocab_size: int, device: torch.device | str, gamma: float, delta: float
    ) -> None:
        self.rows = Rows(active, device)
        self.vocab_size = vocab_size
        self.green_size = int(vocab_size * gamma)
        self.delta = delta
        self._rng = torch.Generator(device="cpu")

    @classmethod
    def build(
        cls, active: Sequence[bool], vocab_size: int, device: torch.device | str, gamma: float, delta: float
    ) -> Self | None:
        """The processor, or None when no row asks for a watermark."""
        return cls(active, vocab_size, device, gamma, delta) if any(active) else None

    def green_ids(self, previous_token: int) -> Tensor:
        """The green list that follows `previous_token` (CPU, long)."""
        self._rng.manual_seed(WATERMARK_HASH_KEY * previous_token)
        return torch.randperm(self.vocab_size, generator=self._rng)[: self.green_size]

    def __call__(self, scores: Tensor, step: StepInputs) -> Tensor:
        return self.rows.apply(scores, step, self.process)

    def process(self, scores: Tensor, step: StepInputs) -> Tensor:
        bias = torch.zeros(scores.shape, dtype=scores.dtype)
        for row, previous in enumerate(step.last_token_ids.tolist()):
            bias[row, self.green_ids(previous)] = self.delta
        return scores.add_(bias.to(scores.device, non_blocking=True))
