"""Multi-LoRA: many adapters over one base model, applied per row in a mixed batch.

A LoRA adapter adds `scale · (x Aᵀ) Bᵀ` to a projection's output (A: [r, in], B: [out, r]). Merging that into the
weights would give one adapter per model copy; here the base projection runs once for the whole batch and the
adapters' deltas are added per row, in a fixed number of operations whatever the mix (the stacked form of
punica's BGMV): the A matrices of the adapters present in the step are stacked, so one GEMM gives every row its
products with all of them; a per-row mask zeroes the products with the other adapters; one GEMM with the stacked
B matrices (scales folded in) adds every delta. Rows of the base model get zeros.

A fused projection (q|k|v, gate|up) is one LoraLinear with one slice per checkpoint module: each slice's B rows
sit in that slice's output columns of the stacked B (zeros elsewhere), so one GEMM serves every slice.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

_STACK_CACHE = 8  # stacks kept per projection, by set of adapters present: a mix usually lasts many steps


@dataclass
class LoraRows:
    """The adapters of the current step's rows, set by the runner before every forward.

    `present`: the adapter indices in the step, sorted; `slot`: for each row, its adapter's position in
    `present`, or len(present) for a row of the base model. No adapter present: every LoraLinear is just its
    base projection.
    """

    present: tuple[int, ...] = ()
    slot: torch.Tensor | None = None
    uniform: bool = False  # every row on the one present adapter: no masking needed

    @property
    def active(self) -> bool:
        return bool(self.present)

    def set(self, adapter_of_row: list[int], device: torch.device) -> None:
        """From the adapter index of each row (-1: the base model), in row order."""
        self.present = tuple(sorted({a for a in adapter_of_row if a >= 0}))
        if not self.present:
            self.slot = None
            return
        self.uniform = len(self.present) == 1 and min(adapter_of_row) >= 0
        position = {a: i for i, a in enumerate(self.present)}
        slots = [position.get(a, len(self.present)) for a in adapter_of_row]
        self.slot = torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True)


@dataclass(frozen=True)
class LoraWeights:
    """One adapter's matrices for one LoraLinear, per slice (None: the adapter does not touch that slice)."""

    a: tuple[torch.Tensor | None, ...]  # [r, in] each
    b: tuple[torch.Tensor | None, ...]  # [width, r] each
    scale: float


@dataclass
class _Stack:
    """The matrices of a set of adapters, stacked for one projection (slice-major columns of A)."""

    at: torch.Tensor  # Aᵀ [in, R]: every present adapter's A, for each slice in turn
    b: torch.Tensor  # [R, out]: each A row's B row (scale folded in), in its slice's columns, zeros elsewhere
    mask: torch.Tensor  # [adapters + 1, R]: 1 on the columns of the row's own adapter (the last row: base, all 0)
    a: torch.Tensor  # A [R, in] (rows, for the fused CPU step's dot products)
    columns: torch.Tensor  # [R, 2] int64: the first output column and width each A row's B row writes


def out_features(projection: nn.Module) -> int:
    """The output width of a projection, through the wrappers that hold one (row-parallel, LoRA) as `.linear`."""
    while not hasattr(projection, "out_features"):
        projection = projection.linear
    return int(projection.out_features)


class LoraLinear(nn.Module):
    """A projection plus the LoRA deltas of the adapters whose rows are in the step."""

    def __init__(self, base: nn.Module, slices: tuple[tuple[int, int], ...], rows: LoraRows) -> None:
        super().__init__()
        self.linear = base  # named like a row-parallel wrapper's, so the fused CPU step sees the base weights
        self.slices = slices  # (first output column, width) of each checkpoint module in the fused output
        self.rows = rows
        self.adapters: dict[int, LoraWeights] = {}
        self._stacks: OrderedDict[tuple[int, ...], _Stack | None] = OrderedDict()

    @property
    def out_features(self) -> int:
        return out_features(self.linear)

    def add(self, index: int, weights: LoraWeights) -> None:
        self.adapters[index] = weights
        self._stacks.clear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        rows = self.rows
        if not rows.active:
            return y
        stack = self._stack(rows.present)
        if stack is None:  # none of the step's adapters touches this projection
            return y
        xa = x @ stack.at
        if not rows.uniform:  # each row keeps only its own adapter's products (none for the base model's rows)
            xa.mul_(stack.mask.index_select(0, rows.slot))
        # Four operations per projection whatever the mix: at rank 16 the op count, not the FLOPs, is the cost.
        return y.addmm_(xa, stack.b)

    def _stack(self, present: tuple[int, ...]) -> _Stack | None:
        if present in self._stacks:
            self._stacks.move_to_end(present)
            return self._stacks[present]
        stack = self._build(present)
        self._stacks[present] = stack
        if len(self._stacks) > _STACK_CACHE:
            self._stacks.popitem(last=False)
        return stack

    def _build(self, present: tuple[int, ...]) -> _Stack | None:
        """Stacks the present adapters' matrices: for each slice, every adapter's A rows, then the next slice."""
        weights = [self.adapters.get(i) for i in present]
        pieces = [
            (k, column, width, w.a[s], w.b[s] * w.scale)
            for s, (column, width) in enumerate(self.slices)
            for k, w in enumerate(weights)
            if w is not None and w.a[s] is not None
        ]
        if not pieces:
            return None
        a = torch.cat([piece[3] for piece in pieces])
        b = a.new_zeros(a.shape[0], self.out_features)
        mask = a.new_zeros(len(present) + 1, a.shape[0])
        columns = torch.zeros(a.shape[0], 2, dtype=torch.int64)
        start = 0
        for owner, column, width, piece_a, piece_b in pieces:
            rank = piece_a.shape[0]
            b[start : start + rank, column : column + width] = piece_b.t()
            mask[owner, start : start + rank] = 1.0
            columns[start : start + rank] = torch.tensor([column, width])
            start += rank
        return _Stack(a.t().contiguous(), b, mask, a.contiguous(), columns)

    def stack_for(self, present: tuple[int, ...]) -> _Stack | None:
        """The stacked matrices of the adapters `present` (None: none of them touches this projection)."""
        return self._stack(present)
