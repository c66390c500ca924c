"""A tiny vision-language model Kettle has no native family for, served through the transformers fallback: a
PaliGemma over the tiny BPE of tests/fixtures.py, with its own processor (PIL backend) saved beside it.

Its tower is SigLIP's on 32 x 32 images in 8 x 8 patches; it takes all 16 patches as image tokens, writes its
images first, then BOS, the prompt and a newline, attends both ways over that whole prompt and counts positions
from 1 (the fallback pads its batches)."""

from __future__ import annotations

import io
from pathlib import Path

from tests.fixtures import make_tokenizer, tiny_config
from tests.vision_fixtures import SIGLIP_32

PALIGEMMA_IMAGE_TOKENS = 16


def _save(model_cls, config, path: Path, seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # biases and norm weights start at 0 and 1: perturbed, they must really be read
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(path, safe_serialization=True)


def make_paligemma_folder(path: Path, seed: int = 0) -> Path:
    """A tiny random PaliGemma with its tokenizer (the processor adds `<image>` and the location and segmentation
    tokens) and processor."""
    from transformers import (
        AutoTokenizer,
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        PaliGemmaProcessor,
        SiglipImageProcessorPil,
    )

    tokenizer = make_tokenizer(path, chat_template=None)
    images = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    images.image_seq_length = PALIGEMMA_IMAGE_TOKENS  # what PaliGemma's preprocessor_config.json carries
    PaliGemmaProcessor(images, tokenizer).save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = tiny_config(tokenizer) | dict(model_type="gemma", head_dim=16, eos_token_id=tokenizer.eos_token_id)
    text |= dict(bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = PaliGemmaConfig(
        text_config=text,
        vision_config=SIGLIP_32 | dict(projection_dim=64),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        projection_dim=64,
        hidden_size=64,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    _save(PaliGemmaForConditionalGeneration, config, path, seed)
    return path


def processed(folder: Path, text: str, files: list[bytes]) -> dict:
    """The model's own processor's inputs for `text` and the images in `files` (PaliGemma's labels left out)."""
    from PIL import Image
    from transformers import AutoProcessor

    images = [Image.open(io.BytesIO(f)).convert("RGB") for f in files] or None
    inputs = AutoProcessor.from_pretrained(folder)(text=text, images=images, return_tensors="pt")
    return {k: v for k, v in inputs.items() if k != "labels"}
