"""Gemma 3's multimodal projector: the SigLIP tower's patch grid averaged down to `mm_tokens_per_image` rows
(a square grid pooled by equal squares), each normed by a Gemma RMSNorm (1 + weight) and projected into the
language model's embedding size by `mm_input_projection_weight` ([vision hidden, text hidden], a plain matrix, not
a Linear's [out, in])."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kettle.layers.linear import Linear
from kettle.models.gemma import gemma_norm
from kettle.tensors.weights import Weights


class Gemma3Projector(nn.Module):
    """features [images, patches, vision hidden] → [images, mm_tokens_per_image, text hidden]."""

    def __init__(self, weights: Weights, prefix: str, config) -> None:
        super().__init__()
        vision = config.vision_config
        self.side = vision.image_size // vision.patch_size  # patches per side of the tower's grid
        self.kernel = self.side // int(config.mm_tokens_per_image**0.5)
        self.norm = gemma_norm(weights, f"{prefix}.mm_soft_emb_norm.weight", vision.layer_norm_eps)
        # Stored [in, out]: transposed once into the [out, in] rows Kettle's Linear reads.
        self.projection = Linear(weights.get(f"{prefix}.mm_input_projection_weight").t().contiguous())

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        images, _, width = features.shape
        grid = features.transpose(1, 2).reshape(images, width, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)  # [images, tokens, width]
        tokens = pooled.shape[1]
        return self.projection(self.norm(pooled.reshape(-1, width))).view(images, tokens, -1)
