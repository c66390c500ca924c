"""The CLIP and SigLIP vision transformers (LLaVA's, LLaVA-NeXT's, PaliGemma's and Gemma 3's towers): patches
embedded by a strided convolution, plus learned positions (and CLIP's class token), then pre-norm encoder layers
of full attention and a GELU MLP. Returns the hidden states after the layer the model reads its features from
(`vision_feature_layer`), running no layer past it.

Linears are Kettle's dense `Linear` (oneDNN-packed float32 on the CPU), never quantized: the tower is small
beside the text model and its numbers go straight into the prompt.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kettle.layers.linear import Linear
from kettle.layers.norm import LayerNorm
from kettle.tensors.weights import Weights

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def _linear(weights: Weights, prefix: str) -> Linear:
    return Linear(weights.get(f"{prefix}.weight"), weights.get_optional(f"{prefix}.bias"))


def _norm(weights: Weights, prefix: str, eps: float) -> LayerNorm:
    return LayerNorm(weights.get(f"{prefix}.weight"), weights.get_optional(f"{prefix}.bias"), eps)


class EncoderLayer(nn.Module):
    """h + attention(norm1(h)), then h + MLP(norm2(h)); attention over every patch of the image."""

    def __init__(self, weights: Weights, prefix: str, config) -> None:
        super().__init__()
        eps, attn = config.layer_norm_eps, f"{prefix}.self_attn"
        self.norm1, self.norm2 = (
            _norm(weights, f"{prefix}.layer_norm1", eps),
            _norm(weights, f"{prefix}.layer_norm2", eps),
        )
        self.qkv = Linear(
            torch.cat([weights.get(f"{attn}.{p}_proj.weight") for p in "qkv"]),
            torch.cat([weights.get(f"{attn}.{p}_proj.bias") for p in "qkv"]),
        )
        self.out = _linear(weights, f"{attn}.out_proj")
        self.fc1, self.fc2 = _linear(weights, f"{prefix}.mlp.fc1"), _linear(weights, f"{prefix}.mlp.fc2")
        self.act = ACTIVATIONS[config.hidden_act]
        self.heads = config.num_attention_heads

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        images, patches, hidden = h.shape
        q, k, v = self.qkv(self.norm1(h).reshape(-1, hidden)).view(images, patches, 3, self.heads, -1).unbind(2)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        h = h + self.out(attended.transpose(1, 2).reshape(-1, hidden)).view(images, patches, hidden)
        return h + self.fc2(self.act(self.fc1(self.norm2(h).reshape(-1, hidden)))).view(images, patches, hidden)


class VisionTower(nn.Module):
    """pixel_values [images, 3, H, W] → the hidden states [images, patches (+1), hidden] of layer `feature_layer`
    (transformers' `hidden_states[feature_layer]`: 0 is the embeddings, -1 the last layer)."""

    def __init__(self, weights: Weights, prefix: str, config, feature_layer: int, post_norm: bool = False) -> None:
        super().__init__()
        embed = f"{prefix}.embeddings"
        self.patch = weights.get(f"{embed}.patch_embedding.weight")
        self.patch_bias = weights.get_optional(f"{embed}.patch_embedding.bias")  # SigLIP's
        self.class_embedding = weights.get_optional(f"{embed}.class_embedding")  # CLIP's
        self.positions = weights.get(f"{embed}.position_embedding.weight")
        eps = config.layer_norm_eps
        has_pre_norm = weights.has(f"{prefix}.pre_layrnorm.weight")  # CLIP's (sic)
        self.pre_norm = _norm(weights, f"{prefix}.pre_layrnorm", eps) if has_pre_norm else None
        depth = config.num_hidden_layers
        run = feature_layer if feature_layer >= 0 else depth + 1 + feature_layer
        if not 0 <= run <= depth:
            raise ValueError(f"vision_feature_layer {feature_layer} is outside a tower of {depth} layers")
        self.layers = nn.ModuleList(EncoderLayer(weights, f"{prefix}.encoder.layers.{i}", config) for i in range(run))
        # `post_norm`: the model reads the tower's last_hidden_state (Idefics3's, SigLIP's), after its final norm.
        self.post_norm = _norm(weights, f"{prefix}.post_layernorm", eps) if post_norm and run == depth else None

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`position_ids` [patches]: which learned position each patch takes (default: the first ones in order)."""
        pixels = pixel_values.to(device=self.patch.device, dtype=self.patch.dtype)  # the processor's are CPU float32
        h = F.conv2d(pixels, self.patch, self.patch_bias, stride=self.patch.shape[-1]).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            h = torch.cat([self.class_embedding.expand(h.shape[0], 1, -1), h], dim=1)
        h = h + (self.positions[: h.shape[1]] if position_ids is None else self.positions[position_ids.to(h.device)])
        if self.pre_norm is not None:
            h = self.pre_norm(h)
        for layer in self.layers:
            h = layer(h)
        return h if self.post_norm is None else self.post_norm(h)
