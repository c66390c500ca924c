"""Tiny vision-language models Kettle has no native family for, served through the transformers fallback: a Gemma 3
and a PaliGemma over the tiny BPE of tests/fixtures.py, each with its own processor (PIL backends) saved beside it.

Both towers are SigLIP's on 32 x 32 images in 8 x 8 patches. Gemma 3 pools the 16 patches to 4 image tokens between
its begin and end tokens (the chat template writes `<start_of_image>`), attends both ways within an image, and has a
sliding-window layer (so the fallback runs it one request per forward); PaliGemma takes all 16, writes its images
first, then BOS, the prompt and a newline, attends both ways over that whole prompt and counts positions from 1
(the fallback pads its batches)."""

from __future__ import annotations

import io
from pathlib import Path

from tests.fixtures import make_tokenizer, tiny_config
from tests.vision_fixtures import IMAGE_CHATML_TEMPLATE

GEMMA3_IMAGE_TOKENS = 4
PALIGEMMA_IMAGE_TOKENS = 16
GEMMA3_CHAT_TEMPLATE = IMAGE_CHATML_TEMPLATE.replace("<image>", "<start_of_image>")
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
_VISION |= dict(image_size=32, patch_size=8)


def _save(model_cls, config, path: Path, seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # biases and norm weights start at 0 and 1: perturbed, they must really be read
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(path, safe_serialization=True)


def make_gemma3_folder(path: Path, seed: int = 0) -> Path:
    """A tiny random Gemma 3 (image-text-to-text) with its tokenizer, processor and chat template."""
    from transformers import (
        AutoTokenizer,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
    )

    tokenizer = make_tokenizer(path, chat_template=GEMMA3_CHAT_TEMPLATE)
    names = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer._set_model_specific_special_tokens(special_tokens=names)  # what Gemma 3's tokenizer_config declares
    tokenizer.save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = Gemma3Processor(images, tokenizer, image_seq_length=GEMMA3_IMAGE_TOKENS)
    processor.chat_template = GEMMA3_CHAT_TEMPLATE
    processor.save_pretrained(path)
    text = tiny_config(tokenizer) | dict(bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    text |= dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    text |= dict(eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    text.pop("model_type", None)
    config = Gemma3Config(
        text_config=text,
        vision_config=_VISION,
        mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
        image_token_id=tokenizer.image_token_id,
        boi_token_id=tokenizer.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_id=tokenizer.convert_tokens_to_ids("<end_of_image>"),
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    _save(Gemma3ForConditionalGeneration, config, path, seed)
    return path


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
        vision_config=_VISION | dict(projection_dim=64),
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
