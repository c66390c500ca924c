"""The image embedding rows of the next forward: which rows of the step's tokens are image tokens, and the
embeddings that replace theirs. The shard's runner sets them before a forward that carries image tokens; the
model's `embed` puts them in place of the token embeddings and forgets them, so the next forward (a decode step)
carries none."""

from __future__ import annotations

import torch


class ImageRows:
    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def set(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """rows [n] (indices into the step's tokens), values [n, hidden]."""
        if rows.shape[0] != values.shape[0]:
            raise ValueError(f"{rows.shape[0]} image rows for {values.shape[0]} embeddings")
        self.rows, self.values = rows, values

    def clear(self) -> None:
        self.rows = self.values = None

    def place(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] with the image rows replaced (once: the rows are cleared)."""
        if self.rows is None or self.values is None:
            return h
        rows, values = self.rows.to(h.device), self.values.to(device=h.device, dtype=h.dtype)
        self.clear()
        return h.index_copy(0, rows, values)
