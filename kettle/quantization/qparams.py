"""Group-wise int4 parameters in one form, whatever checkpoint format they came from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] → int32 [R, 8C]: word c's nibble i (lowest first) becomes column 8c + i."""
    packed = packed.to(torch.int32)
    # An arithmetic shift keeps the sign bits of a negative word, the mask drops them.
    return ((packed[..., None] >> _SHIFTS.to(packed.device)) & 0xF).reshape(*packed.shape[:-1], -1)


@dataclass
class QParams:
    """W[n, k] = (q[n, k] - 8) · scale[k // g, n] + zero[k // g, n]: q int32 [N, K] in 0..15, scale and zero
    float32 [K/g, N] (the float-zero form `Int4Linear` takes)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if k % self.group_size or self.scale.shape != (k // self.group_size, n) or self.zero.shape != self.scale.shape:
            raise ValueError(
                f"int4 parameters do not fit: q {tuple(self.q.shape)}, scale {tuple(self.scale.shape)}, "
                f"zero {tuple(self.zero.shape)}, group size {self.group_size}"
            )

    @classmethod
    def from_scaled_zeros(cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> QParams:
        """From W = s · (q - z) with integer zeros z [K/g, N]: scale = s and zero = s · (8 - z), exactly."""
        return cls(q, scales, scales * (8 - zeros.float()), group)

    @classmethod
    def concat(cls, parts: list[QParams]) -> QParams:
        """Output channels of several layers with the same input (q/k/v, gate/up) stacked in order."""
        sizes = {part.group_size for part in parts}
        if len(sizes) != 1:
            raise ValueError(f"fused projections have different group sizes {sorted(sizes)}")
        return cls(
            torch.cat([part.q for part in parts]),
            torch.cat([part.scale for part in parts], dim=1),
            torch.cat([part.zero for part in parts], dim=1),
            sizes.pop(),
        )

    def dequantized(self) -> torch.Tensor:
        """W as float32 [N, K] (the reference the tests compare against)."""
        n, k = self.q.shape
        groups = self.q.float().view(n, -1, self.group_size) - 8
        return (groups * self.scale.t()[..., None] + self.zero.t()[..., None]).view(n, k)
