"""LLaVA-NeXT (`LlavaNextForConditionalGeneration`): LLaVA's tower, projector and Llama, on "any resolution"
images: the processor resizes an image to the best of `image_grid_pinpoints` and cuts it into tiles of the
tower's size, plus the whole image resized to one tile. The base tile's features come first, then the grid's,
laid out as one large feature map with its padding taken off and a learned `image_newline` after each row.

The grid arithmetic is transformers' own (`get_anyres_image_grid_shape`, `unpad_image`,
`image_size_to_num_patches`), called here so that the rows come in exactly its order.
"""

from __future__ import annotations

import torch

from kettle.models.llava import LlavaForConditionalGeneration
from kettle.tensors.weights import Weights


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    def __init__(self, config, weights: Weights) -> None:
        super().__init__(config, weights)  # the renames map model.image_newline too (llava.py)
        name = "image_newline" if weights.has("image_newline") else "model.image_newline"
        self.image_newline = weights.get(name)
        self.pinpoints = config.image_grid_pinpoints
        self.tile = config.vision_config.image_size
        self.side = config.vision_config.image_size // config.vision_config.patch_size

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor, **_) -> list[torch.Tensor]:
        """pixel_values [images, tiles, 3, H, W] (zero tiles after each image's own), image_sizes [images, 2] (height,
        width) → each image's rows."""
        from transformers.models.llava_next.modeling_llava_next import (
            get_anyres_image_grid_shape,
            image_size_to_num_patches,
            unpad_image,
        )

        counts = [image_size_to_num_patches(size, self.pinpoints, self.tile) for size in image_sizes]
        tiles = torch.cat([images[:n] for images, n in zip(pixel_values, counts, strict=True)])
        features = self.vision_tower(tiles)
        if self.drop_class_token:
            features = features[:, 1:]
        n, seq, width = features.shape
        projected = self.projector(features.reshape(-1, width)).view(n, seq, -1)
        rows = []
        for size, feature in zip(image_sizes, projected.split(counts), strict=True):
            base, grid = feature[0], feature[1:]
            newline = self.image_newline.to(feature.dtype)
            if grid.shape[0] == 0:
                rows.append(torch.cat([base, newline[None]]))
                continue
            grid_h, grid_w = get_anyres_image_grid_shape(size, self.pinpoints, self.tile)
            grid = grid.view(grid_h, grid_w, self.side, self.side, -1).permute(4, 0, 2, 1, 3)
            grid = unpad_image(grid.flatten(1, 2).flatten(2, 3), size)
            grid = torch.cat([grid, newline[:, None, None].expand(*grid.shape[:-1], 1)], dim=-1)
            rows.append(torch.cat([base, grid.flatten(1, 2).transpose(0, 1)]))
        return rows
