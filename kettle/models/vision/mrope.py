"""Multimodal rotary positions (M-RoPE: Qwen2-VL's, Qwen2.5-VL's): three position components per token
(temporal, height, width), each rotating its own sections of the rotary frequencies.

A text token's three components are equal (its place in the sequence, so it rotates as in plain RoPE); an image's
tokens share the position the image starts at, plus their row for the height component and their column for the
width one; the text after an image continues from the image's largest position + 1. So a prompt with images ends
at a smaller position than its length, and every token after the prompt sits at its index + `delta` (the prompt's
largest position + 1 - its length), which the shard keeps per request.

`prompt_positions` computes a prompt's components and delta (transformers' `get_rope_index`, images only);
`RopePositions` carries the next forward's components (or a greedy window's per-sequence deltas) from the shard's
runner to the model; `mrope_cos_sin` turns components into the cos and signed sin tables the attention reads
(kettle/layers/rotary.py's layout).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class RopePositions:
    """The next forward's rotary positions where one position per token does not say them: [3, T] components of
    every token of the step, or [S] offsets of a greedy window's sequences. Taken (and so forgotten) by the model's
    `rope`; the runner clears them after the forward in any case."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def set(self, value: torch.Tensor) -> None:
        self.value = value

    def take(self) -> torch.Tensor | None:
        value, self.value = self.value, None
        return value

    def clear(self) -> None:
        self.value = None


def prompt_positions(
    length: int, images: Sequence[tuple[int, int, tuple[int, int, int]]], merge: int
) -> tuple[torch.Tensor, int]:
    """The [3, length] positions of a prompt whose images are (start, image tokens, (t, h, w) patch grid) in order,
    each a run of t * (h / merge) * (w / merge) tokens; and the delta of the tokens after it."""
    pieces, at, position = [], 0, 0
    for start, tokens, (t, h, w) in images:
        rows, cols = h // merge, w // merge
        if tokens != t * rows * cols or start < at:
            raise ValueError(f"an image of {tokens} tokens at {start} does not fit its grid {(t, h, w)} after {at}")
        pieces.append(torch.arange(position, position + start - at).expand(3, -1))
        position += start - at
        grid = torch.meshgrid(torch.arange(t), torch.arange(rows), torch.arange(cols), indexing="ij")
        pieces.append(torch.stack(grid).reshape(3, -1) + position)
        position += max(rows, cols)
        at = start + tokens
    if at > length:
        raise ValueError(f"an image ends at {at}, past the prompt's {length} tokens")
    pieces.append(torch.arange(position, position + length - at).expand(3, -1))
    positions = torch.cat(pieces, dim=1)
    return positions, int(positions.max()) + 1 - length if length else 0


def mrope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, sections: Sequence[int], dtype: torch.dtype, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [3, T] → cos [T, 1, D] (both halves) and sin [T, 1, D] with its first half negated; frequency j
    of the first `sections[0]` rotates by the temporal component, the next `sections[1]` by the height, and so on
    (transformers' mrope_section, cycling over the three)."""
    component = torch.repeat_interleave(torch.arange(len(sections)) % 3, torch.tensor(sections))
    angles = positions.to(inv_freq.device)[component.to(inv_freq.device)].T.float() * inv_freq
    cos, sin = angles.cos(), angles.sin()
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
    return cos.to(device=device, dtype=dtype).unsqueeze(1), sin.to(device=device, dtype=dtype).unsqueeze(1)
