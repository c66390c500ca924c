"""LLaVA (`LlavaForConditionalGeneration`): a CLIP or SigLIP vision tower, a two-layer projector, and a
Llama-family language model that reads the projected patches in place of the prompt's image tokens.

The language model is Kettle's Llama family over the paged cache, read from the checkpoint under its own names
(`language_model.model.*` in the original layout, `model.language_model.*` in transformers 5's), so every
text-model fast path applies to it. `encode_images` runs the tower and projector on a batch of images; the
shard's runner hands the rows to `image_rows` before the forward that carries them.
"""

from __future__ import annotations

import torch
from torch import nn

from kettle.models.llama import LlamaForCausalLM
from kettle.models.vision.clip import ACTIVATIONS, VisionTower, _linear
from kettle.models.vision.image_rows import ImageRows
from kettle.tensors.weights import Weights

# Checkpoint prefixes → the names the loaders read, for both layouts.
_RENAMES = (
    ("vision_tower.vision_model.", "vision_tower."),  # the tower's own prefix, as llava-hf checkpoints keep it
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.image_newline", "image_newline"),  # LLaVA-NeXT's
)


def canonical_name(name: str) -> str | None:
    for stored, read in _RENAMES:
        if name.startswith(stored):
            return read + name[len(stored) :]
    return None


class Projector(nn.Module):
    """linear_2(act(linear_1(features))): vision features → the language model's embedding size."""

    def __init__(self, weights: Weights, prefix: str, activation: str) -> None:
        super().__init__()
        self.linear_1, self.linear_2 = _linear(weights, f"{prefix}.linear_1"), _linear(weights, f"{prefix}.linear_2")
        self.act = ACTIVATIONS[activation]

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, config, weights: Weights) -> None:
        weights.alias(canonical_name)
        super().__init__(config.text_config, weights)
        layer = config.vision_feature_layer
        if not isinstance(layer, int):
            raise ValueError(f"vision_feature_layer {layer!r}: only one layer is supported")
        self.vision_tower = VisionTower(weights, "vision_tower", config.vision_config, layer)
        self.projector = Projector(weights, "multi_modal_projector", config.projector_hidden_act)
        self.drop_class_token = config.vision_feature_select_strategy == "default"
        self.image_token_id = config.image_token_id
        self.image_rows = ImageRows()
        self.folder = str(weights.folder)  # where the shard finds the image processor's settings

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [images, 3, H, W] → [images, image tokens, hidden]: one row per image token."""
        features = self.vision_tower(pixel_values)
        if self.drop_class_token:
            features = features[:, 1:]
        images, tokens, width = features.shape
        return self.projector(features.reshape(-1, width)).view(images, tokens, -1)
