"""Vision-language models with no native family, run through transformers' `AutoModelForImageTextToText`.

PaliGemma, Aya Vision, Llama 4 ... (Gemma 3 has a native family now: gemma3_vlm.py): the causal fallback's model
(`TransformersCausalLM`, driven by `FallbackRunner`) loaded with its vision tower and projector, plus what the
shard needs to hand it images (`kettle/shard/fallback_images.py`): the folder its image processor is read from, the
image token, and how the model's own processor would write the prompt's token types. Everything a forward does
with the pixel values (the tower, the projector, placing the features at the image tokens, bidirectional attention
over an image) is transformers' own code.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from kettle.models.transformers_fallback import TransformersCausalLM, accepts

logger = logging.getLogger(__name__)


def serves(config) -> bool:
    """Whether `config` is a vision-language model transformers loads as image-text-to-text."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if getattr(config, "vision_config", None) is None:
        return False
    custom = getattr(config, "auto_map", None) or {}
    return config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES or "AutoModelForImageTextToText" in custom


class TransformersVisionLM(TransformersCausalLM):
    """A transformers image-text-to-text model behind the shard's model interface (`FallbackRunner` with images)."""

    def __init__(self, model, dtype: torch.dtype, folder: str) -> None:
        super().__init__(model, dtype)
        self.folder = folder
        config = model.config
        self.image_token_id = getattr(config, "image_token_id", None)
        if self.image_token_id is None:
            self.image_token_id = getattr(config, "image_token_index", None)
        self.position_offset = generation_position_offset(model)
        self.token_types = token_types(model, folder)

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False):
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
        logger.info("No native implementation of %r: serving it, images included, through transformers",
                    model.config.model_type)  # fmt: skip
        return cls(model.to(device).eval(), dtype, path)


def generation_position_offset(model) -> int:
    """What transformers' own `generate` adds to a position before the forward (PaliGemma counts from 1): read from
    the model's `prepare_inputs_for_generation` on a two-token prompt; 0 when it says nothing."""
    ids = torch.zeros((1, 2), dtype=torch.long, device=model.device)
    given = torch.arange(2, device=model.device).unsqueeze(0)
    try:
        prepared = model.prepare_inputs_for_generation(
            ids, position_ids=given, attention_mask=torch.ones_like(ids), is_first_iteration=True
        )
    except Exception:  # custom code with other expectations: its forward gets positions as they are
        return 0
    positions = prepared.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.shape[-1] == 0:
        return 0
    return int(positions.reshape(-1)[-1]) - 1


def token_types(model, folder: str) -> tuple[str, bool] | None:
    """The token types the model's processor returns with a prompt, as (forward argument, modality), or None when
    its forward takes none. `modality`: 1 at image tokens, 0 elsewhere (Gemma 3's token_type_ids, any model's
    mm_token_type_ids); otherwise a tokenizer's type ids of one sequence, all 0 (PaliGemma: its prompt is the
    prefix it attends to both ways)."""
    if accepts(model, "mm_token_type_ids"):
        return "mm_token_type_ids", True
    if not accepts(model, "token_type_ids"):
        return None
    processor = processor_class(folder, model.config.model_type)
    return "token_type_ids", bool(getattr(processor, "return_mm_token_type_ids", False))


def processor_class(folder: str, model_type: str):
    """The model's processor class (not an instance: some need torchvision to build), or None."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = None
    for file in ("processor_config.json", "preprocessor_config.json"):
        try:
            name = json.loads((Path(folder) / file).read_text()).get("processor_class")
        except (OSError, ValueError):
            continue
        if name:
            break
    name = name or PROCESSOR_MAPPING_NAMES.get(model_type)
    try:
        return getattr(transformers, name) if name else None
    except Exception:  # its module needs a backend this machine lacks
        return None
