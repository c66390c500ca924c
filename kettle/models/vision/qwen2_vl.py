"""Qwen2-VL's and Qwen2.5-VL's vision transformer: the image processor's patches (each a flat 3 x 2 x P x P cube:
the frame twice for images) embedded by one projection, full-attention blocks whose queries and keys rotate by
each patch's row and column (2-D RoPE: half the rotary frequencies for the row, half for the column), then the
patch merger: each merge x merge square of patches, which the processor lays out next to each other, normed,
concatenated and projected to the language model's width by a two-layer GELU MLP.

Qwen2-VL's blocks are LayerNorm + a plain MLP; Qwen2.5-VL's are RMSNorm + a gated SiLU MLP with biases, and all
but its `fullatt_block_indexes` attend within windows of `window_size` pixels (the squares reordered window by
window before the blocks, and back after the merger). Attention never crosses images. Linears are Kettle's dense
`Linear`, never quantized, as in the CLIP tower (`clip.py`).
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from kettle.layers.activation import ACTIVATIONS
from kettle.layers.linear import Linear
from kettle.layers.norm import LayerNorm, RMSNorm
from kettle.tensors.weights import Weights

_EPS = 1e-6  # both towers' norms
_VISION_ACTIVATIONS = {**ACTIVATIONS, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


def _linear(weights: Weights, prefix: str) -> Linear:
    return Linear(weights.get(f"{prefix}.weight"), weights.get_optional(f"{prefix}.bias"))


def patch_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """[patches, 2]: each patch's (row, column) in its image, in the processor's order (merge x merge squares one
    after another, row by row; every frame alike)."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        square = (h // merge, merge, w // merge, merge)
        rows, cols = (x.reshape(square).transpose(1, 2).flatten() for x in (rows, cols))
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def window_order(grid_thw: torch.Tensor, merge: int, window: int, patch: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: the order of the merged squares window by window (each image's windows row by row,
    a window's squares row by row), and each window's length in patches."""
    side = window // merge // patch  # squares along a window's side
    order, lengths, base = [], [], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        squares = F.pad(torch.arange(t * gh * gw).view(t, gh, gw), (0, -gw % side, 0, -gh % side), value=-1)
        nh, nw = squares.shape[1] // side, squares.shape[2] // side
        windows = squares.view(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(-1, side * side)
        counts = (windows >= 0).sum(-1)
        flat = windows.flatten()
        order.append(flat[flat >= 0] + base)
        lengths += (counts[counts > 0] * merge * merge).tolist()
        base += t * gh * gw
    return torch.cat(order), lengths


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """q, k, v [N, heads, d] → attention within each consecutive segment of `lengths` tokens (no mask), segments of
    one length batched together."""
    if len(lengths) == 1:
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return out.transpose(0, 1)
    starts = itertools.accumulate(lengths, initial=0)
    by_length: dict[int, list[int]] = defaultdict(list)
    for start, n in zip(starts, lengths, strict=False):
        by_length[n].append(start)
    out = torch.empty_like(q)
    for n, first in by_length.items():
        rows = (torch.tensor(first)[:, None] + torch.arange(n)).reshape(-1).to(q.device)
        q_, k_, v_ = (x[rows].view(len(first), n, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        out[rows] = F.scaled_dot_product_attention(q_, k_, v_).transpose(1, 2).reshape(-1, *q.shape[1:])
    return out


class VisionBlock(nn.Module):
    """h + proj(attention(norm1(h))) with 2-D RoPE on q and k, then h + MLP(norm2(h))."""

    def __init__(self, weights: Weights, prefix: str, heads: int, act: str, rms: bool) -> None:
        super().__init__()
        if rms:
            self.norm1, self.norm2 = (RMSNorm(weights.get(f"{prefix}.{n}.weight"), _EPS) for n in ("norm1", "norm2"))
        else:
            self.norm1, self.norm2 = (
                LayerNorm(weights.get(f"{prefix}.{n}.weight"), weights.get(f"{prefix}.{n}.bias"), _EPS)
                for n in ("norm1", "norm2")
            )
        self.qkv, self.proj = _linear(weights, f"{prefix}.attn.qkv"), _linear(weights, f"{prefix}.attn.proj")
        mlp = f"{prefix}.mlp"
        self.gated = weights.has(f"{mlp}.gate_proj.weight")  # Qwen2.5-VL's
        if self.gated:
            parts = ("gate", "up")
            fused = (torch.cat([weights.get(f"{mlp}.{p}_proj.{k}") for p in parts]) for k in ("weight", "bias"))
            self.up, self.down = Linear(*fused), _linear(weights, f"{mlp}.down_proj")
        else:
            self.up, self.down = _linear(weights, f"{mlp}.fc1"), _linear(weights, f"{mlp}.fc2")
        self.act = _VISION_ACTIVATIONS[act]
        self.heads = heads

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n, width = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(n, 3, self.heads, -1).unbind(1)
        q, k = (_rotate(x, cos, sin) for x in (q, k))
        h = h + self.proj(segment_attention(q, k, v, lengths).reshape(n, width))
        x = self.up(self.norm2(h))
        if self.gated:
            gate, up = x.chunk(2, dim=-1)
            x = self.act(gate) * up
        else:
            x = self.act(x)
        return h + self.down(x)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, d] rotated in float32 (as transformers does), cos and signed sin [N, 1, d]."""
    half = x.shape[-1] // 2
    y = x.float()
    return (y * cos).addcmul_(y.roll(half, dims=-1), sin).to(x.dtype)


class QwenVisionTower(nn.Module):
    """pixel_values [patches, 3 * 2 * P * P] and image_grid_thw [images, 3] (the processor's) → one row per merged
    square [patches / merge², the language model's width], the images one after another."""

    def __init__(self, weights: Weights, prefix: str, config) -> None:
        super().__init__()
        patch = weights.get(f"{prefix}.patch_embed.proj.weight")  # Conv3d [width, 3, 2, P, P], stride = kernel
        self.width = patch.shape[0]
        self.patch = Linear(patch.reshape(self.width, -1).contiguous())  # the convolution of a flat cube
        self.merge, self.patch_size = config.spatial_merge_size, config.patch_size
        heads = config.num_heads
        depth = config.depth
        rms = not weights.has(f"{prefix}.blocks.0.norm1.bias")  # Qwen2.5-VL's RMSNorms
        act = config.hidden_act
        self.blocks = nn.ModuleList(VisionBlock(weights, f"{prefix}.blocks.{i}", heads, act, rms) for i in range(depth))
        # Qwen2.5-VL: windowed attention except in these blocks (Qwen2-VL has no windows: every block is full).
        self.window = getattr(config, "window_size", None)
        self.full_blocks = set(config.fullatt_block_indexes if self.window else range(depth))
        merger = f"{prefix}.merger"
        ln_bias = weights.get_optional(f"{merger}.ln_q.bias")
        ln = weights.get(f"{merger}.ln_q.weight")
        self.merge_norm = RMSNorm(ln, _EPS) if ln_bias is None else LayerNorm(ln, ln_bias, _EPS)
        self.merge_up, self.merge_down = _linear(weights, f"{merger}.mlp.0"), _linear(weights, f"{merger}.mlp.2")
        head_dim = self.width // heads
        theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        quarter = head_dim // 2  # the row's and the column's frequencies each take half of the rotary half
        self.inv_freq = 1.0 / theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter)

    def rotary(self, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [patches, 1, head_dim] for the patches' rows and columns, float32."""
        positions = patch_positions(grid_thw, self.merge).float()
        angles = (positions[:, :, None] * self.inv_freq).flatten(1)  # [rows' | columns'] frequencies
        cos, sin = angles.cos(), angles.sin()
        return torch.cat((cos, cos), -1)[:, None], torch.cat((-sin, sin), -1)[:, None]

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        device, dtype = self.merge_norm.weight.device, self.merge_norm.weight.dtype
        h = self.patch(pixel_values.to(device=device, dtype=dtype))
        cos, sin = (x.to(device) for x in self.rotary(grid_thw))
        frames = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).tolist()
        unit = self.merge * self.merge
        order, windows = None, frames
        if self.window:
            order, windows = window_order(grid_thw, self.merge, self.window, self.patch_size)
            order = order.to(device)
            h, cos, sin = (x.view(-1, unit, *x.shape[1:])[order].flatten(0, 1) for x in (h, cos, sin))
        for i, block in enumerate(self.blocks):
            h = block(h, cos, sin, frames if i in self.full_blocks else windows)
        merged = self.merge_down(F.gelu(self.merge_up(self.merge_norm(h).view(-1, self.width * unit))))
        return merged if order is None else merged[torch.argsort(order)]
