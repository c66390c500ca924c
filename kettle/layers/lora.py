"""Multi-LoRA: many adapters over one base model, applied per group of rows in a mixed batch.

A LoRA adapter adds `scale · (x Aᵀ) Bᵀ` to a projection's output (A: [r, in], B: [out, r]). Merging that into the
weights would give one adapter per model copy; here the base projection runs once for the whole batch and each
adapter's delta runs on its own rows only (the grouped form of punica's SGMV and S-LoRA): two small GEMMs per
adapter present in the step, scattered back with `index_add_`. Rows of the base model pay nothing.

A fused projection (q|k|v, gate|up) is one LoraLinear with one slice per checkpoint module: each slice gets its
own adapter delta in its columns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class LoraRows:
    """Which rows of the current step each adapter owns, set by the runner before every forward.

    `groups` holds (adapter index, row indices); row indices None means every row of the step. Empty: no row
    uses an adapter, and every LoraLinear is just its base projection.
    """

    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def set(self, adapter_of_row: list[int], device: torch.device) -> None:
        """From the adapter index of each row (-1: the base model), in row order."""
        present = sorted({a for a in adapter_of_row if a >= 0})
        if not present:
            self.groups = []
        elif len(present) == 1 and min(adapter_of_row) >= 0:
            self.groups = [(present[0], None)]  # every row on one adapter: no gather, no scatter
        else:
            rows = torch.tensor(adapter_of_row)
            self.groups = [(a, torch.nonzero(rows == a).flatten().to(device)) for a in present]


@dataclass(frozen=True)
class LoraWeights:
    """One adapter's matrices for one LoraLinear: A of every slice stacked ([Σr, in]), B per slice ([w, r])."""

    a: torch.Tensor
    b: tuple[torch.Tensor | None, ...]  # None: the adapter does not touch that slice
    ranks: tuple[int, ...]
    scale: float


class LoraLinear(nn.Module):
    """A projection plus the LoRA deltas of the adapters whose rows are in the step."""

    def __init__(self, base: nn.Module, slices: tuple[tuple[int, int], ...], rows: LoraRows) -> None:
        super().__init__()
        self.linear = base  # named like a row-parallel wrapper's, so the fused CPU step sees the base weights
        self.slices = slices  # (first output column, width) of each checkpoint module in the fused output
        self.rows = rows
        self.adapters: dict[int, LoraWeights] = {}

    @property
    def out_features(self) -> int:
        module = self.linear
        while not hasattr(module, "out_features"):
            module = module.linear
        return int(module.out_features)

    def add(self, index: int, weights: LoraWeights) -> None:
        self.adapters[index] = weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        for index, rows in self.rows.groups:
            weights = self.adapters.get(index)
            if weights is not None:
                self._add_delta(y, x if rows is None else x.index_select(0, rows), rows, weights)
        return y

    def _add_delta(self, y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor | None, w: LoraWeights) -> None:
        xa = (x.to(w.a.dtype) @ w.a.t()) * w.scale  # [n, Σr]: one GEMM for every slice's A
        start = 0
        for (column, width), b, rank in zip(self.slices, w.b, w.ranks, strict=True):
            if b is not None:
                delta = (xa[:, start : start + rank] @ b.t()).to(y.dtype)
                target = y[:, column : column + width]
                if rows is None:
                    target.add_(delta)
                else:
                    target.index_add_(0, rows, delta)
            start += rank
