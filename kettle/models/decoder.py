"""Attention and residual layers shared by Kettle's native families.

`Attention` is one fused-qkv attention for them all; each family passes only the options it has (RoPE
through `rotate`, per-head q/k norms, a sliding window, ALiBi slopes, a score soft-cap, qkv clipping, its own
scale). Two layer contracts:
- `PreNormLayer` / `ParallelLayer` (Llama's block and its relatives): they receive the
  previous layer's output `h` with the residual stream it has not been added to yet (None for the first
  layer) and return the same pair, so each residual add is done by the norm that reads the sum
  (`add_forward`, one fused kernel on CUDA for RMSNorm). `DecoderLM` drives them.
- `SequentialBlock` and the GPT-era families' own blocks add their residuals themselves and return the new
  hidden states (`CausalLM` drives them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kettle.layers.attention import AttentionBackend, AttentionMetadata, get_backend, paged_attention
from kettle.layers.linear import Linear
from kettle.layers.rotary import RotaryEmbedding
from kettle.models.spec import ModelSpec

Rotate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Attention(nn.Module):
    """Fused qkv projection ([q heads; k heads; v heads] rows; clamped to ±clip when set), optional per-head
    q/k norms (Qwen3, Phi's qk_layernorm), RoPE through `rotate` (full, partial or interleaved; None: no RoPE,
    e.g. ALiBi or learned positions), paged attention, output projection."""

    def __init__(
        self,
        qkv: Linear,
        o_proj: Linear,
        spec: ModelSpec,
        rotate: Rotate | None = RotaryEmbedding.apply,
        sliding_window: int | None = None,
        qk_norms: tuple[nn.Module, nn.Module] | None = None,
        *,
        scale: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
        softcap: float | None = None,
        clip: float | None = None,
    ) -> None:
        super().__init__()
        self.qkv, self.o_proj = qkv, o_proj
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.scale = spec.head_dim**-0.5 if scale is None else scale
        self.rotate = rotate
        self.sliding_window = sliding_window
        self.q_norm, self.k_norm = qk_norms or (None, None)
        self.alibi_slopes, self.softcap, self.clip = alibi_slopes, softcap, clip or None
        self.backend: AttentionBackend | None = None  # chosen from the first input's device, then kept

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        heads, qk_heads = self.num_heads, self.num_heads + self.num_kv_heads
        if self.backend is None:  # chosen once, from the first input's device
            self.backend = get_backend(device_type=x.device.type)
        qkv = self.qkv(x)
        if self.clip is not None:
            qkv = qkv.clamp(min=-self.clip, max=self.clip)
        qkv = qkv.view(x.shape[0], qk_heads + self.num_kv_heads, self.head_dim)
        qk = qkv[:, :qk_heads]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
        if self.rotate is not None:
            qk = self.rotate(qk, cos, sin)
        out = paged_attention(
            qk[:, :heads], qk[:, heads:], qkv[:, qk_heads:], k_cache, v_cache, meta, self.scale, self.sliding_window,
            self.alibi_slopes, self.softcap, self.backend,
        )  # fmt: skip
        return self.o_proj(out.reshape(x.shape[0], heads * self.head_dim))


@dataclass(frozen=True)
class BlockPlan:
    """What one layer computes, in the terms the fused CPU decode step reads (kettle/models/decoder_step.py):
    x = input_norm(h); a = attn(x). Sequential: h += attn_out_norm(a); h += mlp_out_norm(mlp(mlp_norm(h))).
    Parallel: h += a + mlp(mlp_norm(h) if mlp_norm else x). A norm that is None is absent."""

    input_norm: nn.Module
    attn: Attention
    mlp: nn.Module
    mlp_norm: nn.Module | None
    parallel: bool = False
    attn_out_norm: nn.Module | None = None
    mlp_out_norm: nn.Module | None = None


def add_norm(norm: nn.Module, h: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(h + residual), h + residual); the first layer has no residual yet, its input is the embedding."""
    if residual is None:
        return norm(h), h
    return norm.add_forward(h, residual)


class SequentialBlock(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x)), each residual added here (GPT-2, GPT-BigCode, MPT, OPT's
    pre-norm layout, Falcon's sequential one)."""

    def __init__(self, input_norm: nn.Module, attn: Attention, post_attention_norm: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_norm, self.attn = input_norm, attn
        self.post_attention_norm, self.mlp = post_attention_norm, mlp

    def forward(self, h, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        h = h + self.attn(self.input_norm(h), cos, sin, k_cache, v_cache, meta)
        return h + self.mlp(self.post_attention_norm(h))

    def plan(self) -> BlockPlan | None:
        """The block in the fused step's terms, None for a subclass that computes something else (a subclass
        with its own forward says its own plan)."""
        if type(self).forward not in (SequentialBlock.forward, PreNormLayer.forward):
            return None
        return BlockPlan(self.input_norm, self.attn, self.mlp, self.post_attention_norm)


class PreNormLayer(SequentialBlock):
    """Sequential pre-norm block carrying the residual (RMSNorm or LayerNorm): x + attn(norm1(x)), then
    x + mlp(norm2(x)), each add done by the norm after it."""

    def forward(
        self, h, residual, cos, sin, k_cache, v_cache, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = add_norm(self.input_norm, h, residual)
        attn = self.attn(x, cos, sin, k_cache, v_cache, meta)
        x, residual = self.post_attention_norm.add_forward(attn, residual)
        return self.mlp(x), residual


class ParallelLayer(nn.Module):
    """Parallel block: x + attn(norm(x)) + mlp(norm(x)) (Phi, GPT-J), or with its own MLP norm,
    x + attn(norm1(x)) + mlp(norm2(x)) (GPT-NeoX with use_parallel_residual)."""

    def __init__(self, input_norm: nn.Module, attn: Attention, mlp: nn.Module, mlp_norm: nn.Module | None = None):
        super().__init__()
        self.input_norm, self.attn, self.mlp, self.mlp_norm = input_norm, attn, mlp, mlp_norm

    def forward(
        self, h, residual, cos, sin, k_cache, v_cache, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = add_norm(self.input_norm, h, residual)
        mlp_in = x if self.mlp_norm is None else self.mlp_norm(residual)
        out = self.attn(x, cos, sin, k_cache, v_cache, meta)
        return out.add_(self.mlp(mlp_in)), residual

    def plan(self) -> BlockPlan | None:
        """The block in the fused step's terms."""
        return BlockPlan(self.input_norm, self.attn, self.mlp, self.mlp_norm, parallel=True)
