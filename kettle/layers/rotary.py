"""Rotary position embeddings (RoPE) with the scalings Llama-family checkpoints use.

Supported `rope_type`s: "default", "linear" (positions interpolated), "dynamic" (NTK-aware base growing past
the trained length), "llama3" (Llama 3.1's per-frequency smoothing) and "longrope" (Phi-3's per-frequency
factors, short or long by each sequence's length). Options for other families, free when unused: a partial
rotary (only the first `rotary_dim` of each head rotates: Phi, GPT-NeoX, GPT-J) and GPT-J's interleaved
layout (pairs 2i, 2i+1 rotate together instead of i, i + D/2). cos/sin are computed in float32 like
Hugging Face's reference, cast to the model dtype once, and kept in a table indexed by position; the table
grows (doubling) only when a step reaches past it, so one step costs one gather of [T, D] rows.
"""

from __future__ import annotations

import math

import torch

from kettle.kernels import ops
from kettle.layers.attention import AttentionMetadata
from kettle.layers.backend import Backend, choose
from kettle.layers.cuda_fused import fused_enabled, rope_qk, unit_stride

SUPPORTED = ("default", "linear", "dynamic", "llama3", "longrope")
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


def longrope_attention_factor(params: dict, max_position_embeddings: int) -> float:
    """Phi-3's cos/sin magnitude: sqrt(1 + ln(factor) / ln(trained length)) unless the config gives one."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding:
    """cos/sin for any positions, plus `apply` to rotate query/key heads in place of Hugging Face's rotate_half.

    `rotary_dim` (default: head_dim × the params' `partial_rotary_factor`) and `interleaved` serve the families
    that rotate part of each head or pairs of neighbours; models call `rotate_fn`, which is the plain
    `apply` (fused on CUDA) for the full halves layout, so Llama-family models pay nothing for the options.
    """

    def __init__(
        self,
        head_dim: int,
        params: dict,
        max_position_embeddings: int,
        dtype: torch.dtype,
        device: torch.device,
        rotary_dim: int | None = None,
        interleaved: bool = False,
    ) -> None:
        self.rope_type = params.get("rope_type", params.get("type", "default"))
        if self.rope_type == "su":
            self.rope_type = "longrope"  # the name Phi-3's first checkpoints used
        if self.rope_type not in SUPPORTED:
            raise ValueError(f"RoPE type {self.rope_type!r} is not supported yet (supported: {', '.join(SUPPORTED)})")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or int(head_dim * params.get("partial_rotary_factor", 1.0))
        self.interleaved = interleaved
        self.params = params
        self.theta = float(params.get("rope_theta", 10000.0))
        self.max_position_embeddings = max_position_embeddings
        self.dtype, self.device = dtype, device
        self.attention_factor = 1.0
        if self.rope_type == "longrope":
            self.attention_factor = longrope_attention_factor(params, max_position_embeddings)
            self.long_inv_freq = self._longrope_frequencies("long_factor").to(device)
        self.inv_freq = self._static_frequencies()
        self.cos, self.sin = self._table(min(max_position_embeddings, _INITIAL_TABLE))
        self.backend = choose(self.cos)  # q/k come in the table's dtype, on its device

    def _static_frequencies(self) -> torch.Tensor:
        inv_freq = base_frequencies(self.rotary_dim, self.theta)
        if self.rope_type == "linear":
            return inv_freq / self.params["factor"]
        if self.rope_type == "llama3":
            return llama3_frequencies(inv_freq, self.params)
        if self.rope_type == "longrope":
            return self._longrope_frequencies("short_factor")
        return inv_freq  # default, and dynamic within the trained length

    def _longrope_frequencies(self, key: str) -> torch.Tensor:
        """Longrope: each base frequency divided by its own factor (short or long list from the config)."""
        return base_frequencies(self.rotary_dim, self.theta) / torch.tensor(self.params[key], dtype=torch.float32)

    def _table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.arange(length, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        return self._cos_sin(angles)

    def _cos_sin(self, angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, R/2] angles → cos [T, 1, R] (both halves) and sin [T, 1, R] with its first half negated.

        The sign folded into the table makes `apply` three ops instead of eight: the rotated half pairs with
        -sin in the first half and +sin in the second, exactly as in Hugging Face's rotate_half. Interleaved
        tables hold each angle twice in a row, the sign on the first of each pair (GPT-J's rotate_every_two).
        """
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        if self.interleaved:
            cos, sin = cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)
        else:
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        cos = cos.to(device=self.device, dtype=self.dtype)
        sin = sin.to(device=self.device, dtype=self.dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def __call__(self, positions: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for each token ([T, 1, R]), gathered once per step and shared by all layers."""
        if self.rope_type == "dynamic" and meta.max_seq_len > self.max_position_embeddings:
            return self._dynamic(positions, meta)
        if meta.max_seq_len > self.cos.shape[0]:
            self.cos, self.sin = self._table(1 << (meta.max_seq_len - 1).bit_length())
        if self.rope_type == "longrope" and meta.max_seq_len > self.params["original_max_position_embeddings"]:
            return self._longrope(positions, meta)
        return self.cos[positions], self.sin[positions]

    def _dynamic(self, positions: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Dynamic NTK: each sequence longer than the trained length gets a larger base, from its own length."""
        factor, trained = self.params["factor"], self.max_position_embeddings
        seq_lens = meta.seq_lens_per_token().clamp(min=trained).float()
        exponent = self.rotary_dim / (self.rotary_dim - 2)
        theta = self.theta * ((factor * seq_lens / trained) - (factor - 1)) ** exponent
        angles = positions.float()[:, None] * base_frequencies(self.rotary_dim, theta[:, None])
        return self._cos_sin(angles)

    def _longrope(self, positions: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens of sequences longer than `original_max_position_embeddings` use the long factors, the others
        the short ones, each sequence by its own length. A sequence that grows past the trained length keeps
        its cached keys (rotated with the short factors), as TGI does; transformers' generate instead
        recomputes the whole sequence with the long factors at that step."""
        original = self.params["original_max_position_embeddings"]
        if meta.decode_only:
            # A decode's sequence length is its position + 1: computed on the device, so a decode CUDA graph
            # replays the choice per step instead of freezing the one made at capture.
            long = (positions >= original)[:, None, None]
        else:
            long = (meta.seq_lens_per_token() > original)[:, None, None]
        angles = positions.float()[:, None] * self.long_inv_freq[None, :]
        long_cos, long_sin = self._cos_sin(angles)
        return torch.where(long, long_cos, self.cos[positions]), torch.where(long, long_sin, self.sin[positions])

    @property
    def rotate_fn(self):
        """The function models call to rotate q/k heads: `apply_halves` for full rotary in halves layout (its
        backend chosen once), else `rotate`."""
        if self.rotary_dim == self.head_dim and not self.interleaved:
            return self.apply_halves
        return self.rotate

    def apply_halves(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`apply` on this table's backend: fused on CUDA, one C call on the CPU (float32), else PyTorch's."""
        if self.backend is Backend.TRITON and unit_stride(x, cos, sin):
            return rope_qk(x, cos, sin)
        if self.backend is Backend.C and ops.rope_fits(x, cos, sin):  # q/k views of the fused qkv output fit
            return ops.rope(x, cos, sin)
        return (x * cos).addcmul_(x.roll(x.shape[-1] // 2, dims=-1), sin)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates the first `rotary_dim` of each head of x [T, heads, D] (halves or interleaved); the rest passes."""
        part = x[..., : self.rotary_dim]
        if self.interleaved:
            # GPT-J pairs neighbours: the partner of 2i is 2i + 1 (rotate_every_two), so swap within each pair.
            partner = part.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        else:
            partner = part.roll(self.rotary_dim // 2, dims=-1)
        rotated = (part * cos).addcmul_(partner, sin)
        if self.rotary_dim == self.head_dim:
            return rotated
        return torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates x [T, heads, D] (halves layout, like Hugging Face checkpoints): x·cos + swap_halves(x)·±sin,
        choosing the backend from x on each call (models call their table's `apply_halves` instead)."""
        if fused_enabled(x) and unit_stride(x, cos, sin):
            return rope_qk(x, cos, sin)  # one kernel on CUDA instead of mul, roll and addcmul
        if ops.rope_fits(x, cos, sin):
            return ops.rope(x, cos, sin)  # the same in one C call on the CPU (float32)
        return (x * cos).addcmul_(x.roll(x.shape[-1] // 2, dims=-1), sin)
