"""Rotary position embeddings (RoPE) with the scalings Llama-family checkpoints use.

Supported `rope_type`s: "default", "linear" (positions interpolated), "dynamic" (NTK-aware base growing past
the trained length) and "llama3" (Llama 3.1's per-frequency smoothing). cos/sin are computed in float32 like
Hugging Face's reference, cast to the model dtype once, and kept in a table indexed by position; the table
grows (doubling) only when a step reaches past it, so one step costs one gather of [T, D] rows.
"""

from __future__ import annotations

import math

import torch

from kettle.layers.attention import AttentionMetadata
from kettle.layers.cuda_fused import fused_enabled, rope_qk, unit_stride

SUPPORTED = ("default", "linear", "dynamic", "llama3")
_INITIAL_TABLE = 4096


def base_frequencies(head_dim: int, theta: float | torch.Tensor) -> torch.Tensor:
    """theta^(-2i/d) for i < d/2, float32; `theta` may be a [N, 1] tensor (one base per row)."""
    device = theta.device if isinstance(theta, torch.Tensor) else None
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta**exponents)


def llama3_frequencies(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, the band between interpolated."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(in_band, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin for any positions, plus `apply` to rotate query/key heads in place of Hugging Face's rotate_half."""

    def __init__(
        self, head_dim: int, params: dict, max_position_embeddings: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.rope_type = params.get("rope_type", params.get("type", "default"))
        if self.rope_type not in SUPPORTED:
            raise ValueError(f"RoPE type {self.rope_type!r} is not supported yet (supported: {', '.join(SUPPORTED)})")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial rotary embeddings are not supported for this architecture")
        self.head_dim = head_dim
        self.params = params
        self.theta = float(params.get("rope_theta", 10000.0))
        self.max_position_embeddings = max_position_embeddings
        self.dtype, self.device = dtype, device
        self.inv_freq = self._static_frequencies()
        self.cos, self.sin = self._table(min(max_position_embeddings, _INITIAL_TABLE))

    def _static_frequencies(self) -> torch.Tensor:
        inv_freq = base_frequencies(self.head_dim, self.theta)
        if self.rope_type == "linear":
            return inv_freq / self.params["factor"]
        if self.rope_type == "llama3":
            return llama3_frequencies(inv_freq, self.params)
        return inv_freq  # default, and dynamic within the trained length

    def _table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.arange(length, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        return self._cos_sin(angles)

    def _cos_sin(self, angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, D/2] angles → cos [T, 1, D] (both halves) and sin [T, 1, D] with its first half negated.

        The sign folded into the table makes `apply` three ops instead of eight: the rotated half pairs with
        -sin in the first half and +sin in the second, exactly as in Hugging Face's rotate_half.
        """
        cos, sin = angles.cos(), angles.sin()
        cos = torch.cat((cos, cos), dim=-1).to(device=self.device, dtype=self.dtype)
        sin = torch.cat((-sin, sin), dim=-1).to(device=self.device, dtype=self.dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def __call__(self, positions: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for each token ([T, 1, D]), gathered once per step and shared by all layers."""
        if self.rope_type == "dynamic" and meta.max_seq_len > self.max_position_embeddings:
            return self._dynamic(positions, meta)
        if meta.max_seq_len > self.cos.shape[0]:
            self.cos, self.sin = self._table(1 << (meta.max_seq_len - 1).bit_length())
        return self.cos[positions], self.sin[positions]

    def _dynamic(self, positions: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Dynamic NTK: each sequence longer than the trained length gets a larger base, from its own length."""
        factor, trained = self.params["factor"], self.max_position_embeddings
        seq_lens = meta.seq_lens_per_token().clamp(min=trained).float()
        exponent = self.head_dim / (self.head_dim - 2)
        theta = self.theta * ((factor * seq_lens / trained) - (factor - 1)) ** exponent
        angles = positions.float()[:, None] * base_frequencies(self.head_dim, theta[:, None])
        return self._cos_sin(angles)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates x [T, heads, D] (halves layout, like Hugging Face checkpoints): x·cos + swap_halves(x)·±sin."""
        if fused_enabled(x) and unit_stride(x, cos, sin):
            return rope_qk(x, cos, sin)  # one kernel on CUDA instead of mul, roll and addcmul
        return (x * cos).addcmul_(x.roll(x.shape[-1] // 2, dims=-1), sin)
