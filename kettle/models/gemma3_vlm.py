"""Gemma 3 with images (`Gemma3ForConditionalGeneration`, model type `gemma3`): a SigLIP tower (its last layer
and final norm), the pooling projector (`vision/gemma3_projector.py`) and Gemma 3's language model
(kettle/models/gemma3.py) over the paged cache, which reads the projected rows in place of the prompt's
`<image_soft_token>`s.

The rows replace the embeddings after Gemma's sqrt(hidden) scaling (`CausalLM.embed` places them last), as in
transformers, where the scaled embedding is computed first and the image features are scattered over it.

An image's tokens attend to each other both ways (transformers' token-type mask): each run of image tokens in a
prompt chunk is a span of the prefill's mask (`both_ways_token`, `AttentionMetadata.attend_both_ways`), so a
chunk must hold all of an image's tokens that are not cached yet; the router never ends a chunk inside such an
image (`ImageTokens.whole`), and the shard refuses one that does (`image_inputs.py`).

Checkpoints are read under both layouts: the original (`language_model.model.*`, `vision_tower.vision_model.*`,
`multi_modal_projector.*`) and transformers 5's (`model.language_model.*`, `model.vision_tower.*`, ...).
"""

from __future__ import annotations

import torch

from kettle.models.gemma3 import Gemma3ForCausalLM
from kettle.models.llava import canonical_name
from kettle.models.vision.clip import VisionTower
from kettle.models.vision.gemma3_projector import Gemma3Projector
from kettle.models.vision.image_rows import ImageRows
from kettle.tensors.weights import Weights


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3's tower, projector and language model built directly from a checkpoint's tensors."""

    def __init__(self, config, weights: Weights) -> None:
        weights.alias(canonical_name)
        text = config.text_config
        # transformers 5 says whether the head is tied on the outer config; a checkpoint without a head ties it.
        text.tie_word_embeddings = getattr(config, "tie_word_embeddings", True) or not weights.has("lm_head.weight")
        super().__init__(text, weights)
        self.vision_tower = VisionTower(weights, "vision_tower", config.vision_config, -1, post_norm=True)
        self.projector = Gemma3Projector(weights, "multi_modal_projector", config)
        self.image_token_id = config.image_token_id
        if self.image_token_id >= text.vocab_size:  # transformers embeds it as token 0 then; no checkpoint does
            raise ValueError(f"image token {self.image_token_id} is outside the vocabulary ({text.vocab_size})")
        self.both_ways_token = self.image_token_id
        self.image_rows = ImageRows()
        self.folder = str(weights.folder)  # where the shard finds the image processor's settings

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor, **_) -> torch.Tensor:
        """pixel_values [images, 3, H, W] → [images, mm_tokens_per_image, hidden]: one row per image token."""
        return self.projector(self.vision_tower(pixel_values))
