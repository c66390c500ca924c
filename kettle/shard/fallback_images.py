"""The images of the transformers fallback's prompts: what the model's own processor would hand its forward.

A vision-language model with no native family (`kettle/models/transformers_vision.py`) runs whole in transformers,
so a prompt with images is computed as `generate` computes it: in one forward from its first token, with the
pixel values of its images (and whatever else its image processor returns that the forward takes: image_sizes,
pixel_attention_mask ...) and the token types its processor writes (Gemma 3 attends both ways within an image,
PaliGemma over its whole prompt). So such a prompt is never split: while the router's chunks have not reached its
end, the runner computes nothing for it (`ready`), and the chunk that completes it runs it all. The steps after
the prompt are the fallback's plain decode steps (no pixels, no token types, as `generate`'s).

The image bytes are the router's (`RequestState.images`), decoded with Pillow and preprocessed by the model's image
processor (transformers' PIL backend), all the images of a forward in one call, in the order of their tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kettle.models.transformers_fallback import accepts
from kettle.shard.batch import RequestState
from kettle.shard.image_inputs import decoded

logger = logging.getLogger(__name__)


class FallbackImages:
    """Builds the image inputs of the fallback's forwards for one `TransformersVisionLM`."""

    def __init__(self, model, processor, processor_kwargs: dict | None = None) -> None:
        self.model = model
        self.processor = processor
        self.processor_kwargs = processor_kwargs or {}

    @classmethod
    def load(cls, model) -> FallbackImages | None:
        """The model's image processor, with the defaults its processor passes it; None (text only, logged) when the
        folder has none this machine can build."""
        from kettle.models.transformers_vision import processor_class
        from kettle.shard.image_inputs import load_image_processor

        try:
            processor = load_image_processor(model.folder)
        except Exception as error:
            logger.warning("No image processor for %s (%s): requests with images are refused", model.folder, error)
            return None
        # What the model's processor passes its image processor (Gemma 3: pan-and-scan off), where it takes it.
        defaults = getattr(processor_class(model.folder, model.config.model_type), "images_kwargs", None) or {}
        known = getattr(getattr(processor, "valid_kwargs", None), "__annotations__", {})
        return cls(model, processor, {k: v for k, v in defaults.items() if k in known and k != "return_tensors"})

    @staticmethod
    def ready(requests: Sequence[RequestState], ends: Sequence[int]) -> tuple[list[RequestState], list[int]]:
        """The requests to compute this step: all but those with images whose prompt does not end in it."""
        kept = [(r, end) for r, end in zip(requests, ends, strict=True) if not r.images or end >= r.prompt_len]
        return [r for r, _ in kept], [end for _, end in kept]

    def inputs(
        self, requests: Sequence[RequestState], pasts: Sequence[int], tokens: Sequence[Sequence[int]], width: int
    ) -> dict:
        """The forward's image arguments for rows of `tokens` left-padded to `width`; {} when no row is a prompt with
        images (a prompt with images is computed whole, from its first token: see `ready`)."""
        files = [image.data for r, past in zip(requests, pasts, strict=True) if past == 0 for image in r.images]
        if not files:
            return {}
        device, dtype = self.model.model.device, self.model.spec.dtype
        inputs = {}
        for key, value in self.features(files).items():
            if isinstance(value, torch.Tensor) and accepts(self.model.model, key):
                inputs[key] = value.to(device, dtype) if value.is_floating_point() else value.to(device)
        if self.model.token_types is not None:
            name, modality = self.model.token_types
            rows = [[0] * (width - len(t)) + self._types(t, modality) for t in tokens]
            inputs[name] = torch.tensor(rows, dtype=torch.long, device=device)
        return inputs

    def features(self, files: Sequence[bytes]) -> dict:
        """The image processor's batch for `files` (first frames, in RGB)."""
        return dict(self.processor(images=decoded(files), return_tensors="pt", **self.processor_kwargs))

    def _types(self, tokens: Sequence[int], modality: bool) -> list[int]:
        if not modality:
            return [0] * len(tokens)
        return [int(token == self.model.image_token_id) for token in tokens]
