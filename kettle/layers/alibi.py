"""ALiBi slopes: the per-head linear distance penalty BLOOM, MPT and Falcon-alibi use instead of positions.

Each family derives its slopes its own way (MPT's differ from BLOOM's for head counts that are not powers
of two); both are computed here in float32 exactly as Hugging Face computes them, and passed to
`paged_attention(alibi_slopes=...)`, which adds slope_h · (key_pos - query_pos) to the scaled scores.
"""

from __future__ import annotations

import math

import torch


def bloom_alibi_slopes(num_heads: int) -> torch.Tensor:
    """[num_heads] float32 slopes of BLOOM and Falcon: a geometric series 2^(-8i/n) over the largest power of
    two n ≤ num_heads, then every other term of the series for 2n to fill the remaining heads."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest != num_heads:
        extra_base = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32)
        remaining = min(closest, num_heads - closest)
        extra = torch.pow(extra_base, torch.arange(1, 1 + 2 * remaining, 2, dtype=torch.int32))
        slopes = torch.cat([slopes, extra])
    return slopes


def mpt_alibi_slopes(num_heads: int, alibi_bias_max: float = 8.0) -> torch.Tensor:
    """[num_heads] float32 slopes of MPT: 1 / 2^(i · bias_max / n) over the next power of two n ≥ num_heads,
    reordered odd terms first and cut to num_heads when num_heads is not a power of two."""
    padded = 2 ** math.ceil(math.log2(num_heads))
    exponents = torch.arange(1, padded + 1, dtype=torch.int64).float() * (alibi_bias_max / padded)
    slopes = 1.0 / torch.pow(2, exponents)
    if padded != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes
