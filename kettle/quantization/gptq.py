"""Reading GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum layout) into Kettle's int4 form.

Per linear layer `<prefix>` a GPTQ checkpoint stores, for W [N out, K in] in groups of g input channels:

- `qweight` int32 [K/8, N]: eight 4-bit values of consecutive input channels per word, the first in the
  lowest nibble (packed along the input dimension);
- `qzeros` int32 [K/g, N/8]: the zero points, eight consecutive output channels per word, lowest first;
- `scales` float16 [K/g, N]; `g_idx` int32 [K]: the group of each input channel; optional `bias` [N].

W[n, k] = scales[g, n] · (q[k, n] - z[g, n]) with g = g_idx[k]. The original format ("gptq", v1) stores
each zero minus one (so a symmetric checkpoint stores 7 for 8); `checkpoint_format: "gptq_v2"` stores it as is.
Act-order checkpoints (`desc_act`, a g_idx that is not k // g) are refused: their input channels would need
a per-layer permutation, which q/k/v and gate/up fusion cannot share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kettle.quantization.qparams import QParams, unpack_nibbles
from kettle.tensors.weights import Weights


@dataclass(frozen=True)
class GptqFormat:
    """The `quantization_config` of a GPTQ checkpoint, validated."""

    bits: int = 4
    group_size: int = 128
    desc_act: bool = False
    zero_offset: int = 1  # 1 for the v1 format (zeros stored minus one), 0 for gptq_v2

    def __post_init__(self) -> None:
        if self.bits != 4:
            raise ValueError(f"GPTQ with {self.bits} bits is not supported: Kettle serves 4-bit GPTQ checkpoints")
        if self.desc_act:
            raise ValueError(
                "GPTQ act-order checkpoints (desc_act=true) are not supported: use one quantized without act-order"
            )

    @classmethod
    def from_config(cls, config: dict) -> GptqFormat:
        """From the `quantization_config` dict of config.json."""
        fmt = config.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq or gptq_v2)")
        return cls(
            bits=int(config.get("bits", 4)),
            group_size=int(config.get("group_size", 128)),
            desc_act=bool(config.get("desc_act", False)),
            zero_offset=1 if fmt == "gptq" else 0,
        )

    def is_quantized(self, weights: Weights, prefix: str) -> bool:
        return weights.has(f"{prefix}.qweight")

    def load(self, weights: Weights, prefix: str) -> QParams:
        """The layer `prefix` as q [N, K] and float-zero scale/zero [K/g, N]."""
        packed = weights.get(f"{prefix}.qweight")
        q = unpack_nibbles(packed.t()).contiguous()  # [N, K/8] words → [N, K]
        in_features = q.shape[1]
        group = in_features if self.group_size == -1 else self.group_size
        self._check_g_idx(weights, prefix, in_features, group)
        zeros = unpack_nibbles(weights.get(f"{prefix}.qzeros")) + self.zero_offset  # [K/g, N]
        scales = weights.get(f"{prefix}.scales").float()
        return QParams.from_scaled_zeros(q, scales, zeros, group)

    def _check_g_idx(self, weights: Weights, prefix: str, in_features: int, group: int) -> None:
        g_idx = weights.get_optional(f"{prefix}.g_idx")
        if g_idx is None:
            return
        expected = torch.arange(in_features, device=g_idx.device) // group
        if not torch.equal(g_idx.to(expected.dtype), expected):
            raise ValueError(
                f"GPTQ layer {prefix} has an act-order g_idx (input channels out of group order), which is not "
                "supported: use a checkpoint quantized without act-order (desc_act=false)"
            )
