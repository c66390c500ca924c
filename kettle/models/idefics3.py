"""Idefics3 (`Idefics3ForConditionalGeneration`: SmolVLM, Idefics3-8B): a SigLIP-style vision tower run on each
tile of an image (the processor cuts it into a grid of tiles plus the whole image as one more), a connector that
folds each tile's patches by `scale_factor` (pixel shuffle) and projects them, and a Llama language model that
reads one row per `<image>` token, the tiles in the processor's order.

The language model is Kettle's Llama family over the paged cache (`model.text_model.*` read under the Llama
names). `encode_images` takes the image processor's batch (images x tiles, zero tiles padding the shorter ones)
and returns each image's rows.
"""

from __future__ import annotations

import torch

from kettle.layers.linear import Linear
from kettle.models.llama import LlamaForCausalLM
from kettle.models.vision.clip import VisionTower
from kettle.models.vision.image_rows import ImageRows
from kettle.tensors.weights import Weights

_RENAMES = (
    ("model.text_model.", "model."),
    ("model.vision_model.", "vision_model."),
    ("model.connector.", "connector."),
)


def canonical_name(name: str) -> str | None:
    for stored, read in _RENAMES:
        if name.startswith(stored):
            return read + name[len(stored) :]
    return None


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[tiles, side*side, d] → [tiles, side*side / scale², d * scale²]: each scale x scale square of patches in one
    row (transformers' Idefics3Connector.pixel_shuffle)."""
    tiles, seq, dim = x.shape
    side = int(seq**0.5)
    x = x.view(tiles, side, side // scale, dim * scale).permute(0, 2, 1, 3)
    x = x.reshape(tiles, side // scale, side // scale, dim * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(tiles, seq // (scale * scale), dim * scale * scale)


def tile_positions(patches_h: int, patches_w: int, per_side: int) -> torch.Tensor:
    """The learned position of each patch of a whole tile of patches_h x patches_w patches, bucketed onto the
    tower's per_side x per_side grid exactly as transformers computes it (Idefics3VisionEmbeddings)."""
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side)
    rows = torch.arange(patches_h, dtype=torch.float32) * (1.0 / torch.tensor(patches_h))
    cols = torch.arange(patches_w, dtype=torch.float32) * (1.0 / torch.tensor(patches_w))
    rows = torch.bucketize(torch.clamp(rows, max=1.0 - 1e-6), boundaries, right=True)
    cols = torch.bucketize(torch.clamp(cols, max=1.0 - 1e-6), boundaries, right=True)
    return (rows[:, None] * per_side + cols[None, :]).reshape(-1)


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    image_batches_nested = True  # the image processor takes one list of images per image (each cut into tiles)

    def __init__(self, config, weights: Weights) -> None:
        weights.alias(canonical_name)
        super().__init__(config.text_config, weights)
        vision = config.vision_config
        self.vision_tower = VisionTower(weights, "vision_model", vision, -1, post_norm=True)
        self.projection = Linear(weights.get("connector.modality_projection.proj.weight"))
        self.scale = config.scale_factor
        self.patch_size, self.per_side = vision.patch_size, vision.image_size // vision.patch_size
        self.image_token_id = config.image_token_id
        self.image_rows = ImageRows()
        self.folder = str(weights.folder)  # where the shard finds the image processor's settings

    @torch.inference_mode()
    def encode_images(
        self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor | None = None, **_
    ) -> list[torch.Tensor]:
        """pixel_values [images, tiles, 3, H, W] → each image's rows [its tiles x image_seq_len, hidden]."""
        images, tiles = pixel_values.shape[:2]
        flat = pixel_values.reshape(images * tiles, *pixel_values.shape[2:])
        real = (flat == 0.0).sum(dim=(-1, -2, -3)) != flat[0].numel()
        if pixel_attention_mask is not None:
            masks = pixel_attention_mask.reshape(images * tiles, *pixel_attention_mask.shape[2:])[real]
            if not bool(masks.all()):
                raise NotImplementedError("Idefics3 tiles with padding inside them are not supported yet")
        kept = flat[real]
        positions = tile_positions(kept.shape[-2] // self.patch_size, kept.shape[-1] // self.patch_size, self.per_side)
        features = pixel_shuffle(self.vision_tower(kept, positions), self.scale)
        n, seq, width = features.shape
        rows = self.projection(features.reshape(-1, width)).view(n, seq, -1)
        per_image = real.view(images, tiles).sum(dim=1).tolist()
        return [part.reshape(-1, part.shape[-1]) for part in rows.split(per_image)]
