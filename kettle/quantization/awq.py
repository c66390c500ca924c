"""Reading AWQ checkpoints (AutoAWQ's GEMM layout) into Kettle's int4 form.

Per linear layer `<prefix>` an AWQ checkpoint stores, for W [N out, K in] in groups of g input channels:

- `qweight` int32 [K, N/8]: eight 4-bit values of output channels per word (packed along the output
  dimension), interleaved: nibble i (bits 4i..4i+3) holds channel 8c + ORDER[i] with ORDER = [0,2,4,6,1,3,5,7];
- `qzeros` int32 [K/g, N/8]: the zero points, packed the same way; `scales` float16 [K/g, N]; optional `bias`.

W[n, k] = scales[g, n] · (q[k, n] - z[g, n]) with g = k // group_size (no offset on the zeros, unlike GPTQ v1).
Only the GEMM layout (`version: "gemm"`) with zero points is read; GEMV/Marlin/exllama layouts are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kettle.quantization.qparams import QParams, unpack_nibbles
from kettle.tensors.weights import Weights

# Nibble i of a word holds output channel ORDER[i] of its eight; channel j therefore sits in nibble INVERSE[j].
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
INVERSE = tuple(ORDER.index(j) for j in range(8))  # (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[R, N/8] int32 words packed along the output dimension in AWQ's order → [R, N] int32 in channel order."""
    nibbles = unpack_nibbles(packed)
    rows = nibbles.shape[0]
    return nibbles.view(rows, -1, 8)[..., list(INVERSE)].reshape(rows, -1)


@dataclass(frozen=True)
class AwqFormat:
    """The `quantization_config` of an AWQ checkpoint, validated."""

    bits: int = 4
    group_size: int = 128
    version: str = "gemm"
    zero_point: bool = True

    def __post_init__(self) -> None:
        if self.bits != 4:
            raise ValueError(f"AWQ with {self.bits} bits is not supported: Kettle serves 4-bit AWQ checkpoints")
        if self.version != "gemm":
            raise ValueError(f"AWQ version {self.version!r} is not supported: Kettle reads the GEMM layout only")
        if not self.zero_point:
            raise ValueError("AWQ checkpoints without zero points are not supported")

    @classmethod
    def from_config(cls, config: dict) -> AwqFormat:
        """From the `quantization_config` dict of config.json (`bits` or `w_bit`, `group_size` or `q_group_size`)."""
        return cls(
            bits=int(config.get("bits", config.get("w_bit", 4))),
            group_size=int(config.get("group_size", config.get("q_group_size", 128))),
            version=str(config.get("version", "gemm")).lower(),
            zero_point=bool(config.get("zero_point", True)),
        )

    def is_quantized(self, weights: Weights, prefix: str) -> bool:
        return weights.has(f"{prefix}.qweight")

    def load(self, weights: Weights, prefix: str) -> QParams:
        """The layer `prefix` as q [N, K] and float-zero scale/zero [K/g, N]."""
        q = unpack_awq(weights.get(f"{prefix}.qweight")).t().contiguous()  # [K, N] → [N, K]
        group = q.shape[1] if self.group_size == -1 else self.group_size
        zeros = unpack_awq(weights.get(f"{prefix}.qzeros"))
        scales = weights.get(f"{prefix}.scales").float()
        return QParams.from_scaled_zeros(q, scales, zeros, group)
