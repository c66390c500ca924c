"""Qwen2-VL and Qwen2.5-VL (`Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration`): a vision
transformer with 2-D rotary positions and a patch merger (`vision/qwen2_vl.py`), and a Qwen2 language model that
reads the merged patches in place of the prompt's `<|image_pad|>` tokens, with multimodal rotary positions
(M-RoPE, `vision/mrope.py`).

The language model is Kettle's Llama family (Qwen2: biases on q/k/v) over the paged cache, read under its own
names (`model.language_model.*` in transformers 5's layout, `model.*` in the original one), so every text-model
fast path applies: the rotation itself is RoPE's, only its cos and sin come per token. `rope` computes them from
the three components the shard's runner sets for the step (`rope_positions`: every token's, from the prompt's
image grids and each request's decode offset), or from the plain positions of a step without images, where the
three are equal.
"""

from __future__ import annotations

import torch
from torch import nn

from kettle.layers.attention import AttentionMetadata
from kettle.layers.norm import RMSNorm
from kettle.models.hf_config import layer_windows, rope_parameters
from kettle.models.llama import LlamaForCausalLM
from kettle.models.vision.image_rows import ImageRows
from kettle.models.vision.mrope import RopePositions, mrope_cos_sin, prompt_positions
from kettle.models.vision.qwen2_vl import QwenVisionTower
from kettle.tensors.weights import Weights

_RENAMES = (
    ("model.language_model.", "model."),
    ("model.visual.", "visual."),
)


def canonical_name(name: str) -> str | None:
    for stored, read in _RENAMES:
        if name.startswith(stored):
            return read + name[len(stored) :]
    return None


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, config, weights: Weights) -> None:
        nn.Module.__init__(self)
        weights.alias(canonical_name)
        text = getattr(config, "text_config", None) or config  # transformers < 4.52: one flat config
        rope = rope_parameters(text)
        self.sections = list(rope.pop("mrope_section", None) or (16, 24, 24))  # transformers' default
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
            raise ValueError(f"Qwen2-VL with RoPE type {rope.get('rope_type')!r} is not supported (only the default)")
        rope["rope_type"] = "default"
        rope.pop("type", None)
        # transformers 5 keeps tie_word_embeddings on the outer config only; the layout reads it from the text one.
        text.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
        self.load_llama_layout(text, weights, rope, layer_windows(text))
        self.norm = RMSNorm(weights.get("model.norm.weight"), text.rms_norm_eps)
        if 2 * sum(self.sections) != self.rotary.rotary_dim:
            raise ValueError(f"mrope_section {self.sections} does not cover half the head size {self.spec.head_dim}")
        vision = config.vision_config
        self.vision_tower = QwenVisionTower(weights, "visual", vision)
        self.merge = vision.spatial_merge_size
        self.image_token_id = config.image_token_id
        self.image_rows = ImageRows()
        self.rope_positions = RopePositions()
        self.folder = str(weights.folder)  # where the shard finds the image processor's settings

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, **_) -> list[torch.Tensor]:
        """The processor's patches of a batch of images and their grids → each image's rows [its tokens, hidden]."""
        rows = self.vision_tower(pixel_values, image_grid_thw)
        return list(rows.split((image_grid_thw.prod(-1) // (self.merge * self.merge)).tolist()))

    @staticmethod
    def image_grid(processor, width: int, height: int) -> tuple[int, int, int]:
        """The (t, h, w) patch grid `processor` gives an image of this size (its own resize arithmetic)."""
        try:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
        except ImportError:  # transformers 4: one image processor module
            from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        size = processor.size
        lowest = getattr(processor, "min_pixels", None) or size["shortest_edge"]
        highest = getattr(processor, "max_pixels", None) or size["longest_edge"]
        patch = processor.patch_size
        resized_h, resized_w = smart_resize(height, width, patch * processor.merge_size, lowest, highest)
        return 1, resized_h // patch, resized_w // patch

    def prompt_rope(self, length: int, images) -> tuple[torch.Tensor, int]:
        """The prompt's [3, length] rotary positions and its decode offset, its images given as (start, image
        tokens, grid) (`mrope.prompt_positions`)."""
        return prompt_positions(length, images, self.merge)

    def rope(self, positions: torch.Tensor, meta: AttentionMetadata):
        """cos and sin of the step: from the runner's M-RoPE components when it set them, else plain RoPE (text
        only: the three components equal the position)."""
        given = self.rope_positions.take()
        if given is None:
            return self.rotary(positions, meta)
        if given.dim() == 1:  # a greedy window's offsets per sequence; its positions are steps x sequences
            shifted = positions + given.to(positions.device).repeat(positions.shape[0] // given.shape[0])
            return self.rotary(shifted, meta)
        rotary = self.rotary
        return mrope_cos_sin(given, rotary.inv_freq, self.sections, rotary.dtype, rotary.device)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """The same language model and M-RoPE; its tower has RMSNorm, gated MLPs and windowed attention, which
    `QwenVisionTower` reads from the checkpoint and config."""
