"""Tiny vision-language models and their processors, built at test time (no downloads): a LLaVA whose tokenizer
is the tiny BPE of tests/fixtures.py with an `<image>` token, a CLIP vision tower of 32x32 images in 8x8 patches
(16 image tokens an image), and a ChatML template that writes `<image>` for an image part."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

from tests.fixtures import make_tokenizer, tiny_config

IMAGE_CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAVA_IMAGE_TOKENS = 16


def image_bytes(fmt: str = "PNG", size: tuple[int, int] = (8, 6), frames: int = 1, seed: int = 0) -> bytes:
    """A small image file whose pixels follow `seed`."""
    from PIL import Image

    out = io.BytesIO()
    images = [Image.new("RGB", size, ((40 * i + 70 * seed) % 256, 100, (200 + 31 * seed) % 256)) for i in range(frames)]
    for image in images:  # a gradient, so resizing and cropping matter
        for x in range(size[0]):
            image.putpixel((x, x * size[1] // size[0]), (255, (x * 37 + seed * 11) % 256, 0))
    images[0].save(out, format=fmt, save_all=frames > 1, append_images=images[1:])
    return out.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def make_llava_folder(path: Path, *, weights: bool = False, seed: int = 0, tower: str = "clip") -> Path:
    """A tiny LLaVA in `path`: tokenizer, processor files and config (and random weights with `weights`); `tower`
    "clip" (a class token the `default` strategy drops, the second-to-last layer) or "siglip" (no class token,
    every patch: the `full` strategy, the last layer)."""
    from transformers import CLIPImageProcessorPil, LlavaConfig, LlavaProcessor, SiglipImageProcessorPil

    clip = tower == "clip"

    tokenizer = make_tokenizer(path, chat_template=IMAGE_CHATML_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.save_pretrained(path)
    if clip:
        images = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    else:
        images = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    processor = LlavaProcessor(
        images,
        tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default" if clip else "full",
        num_additional_image_tokens=1 if clip else 0,  # CLIP's class token, which the `default` strategy drops
        chat_template=IMAGE_CHATML_TEMPLATE,
    )
    processor.save_pretrained(path)
    vision = dict(
        model_type="clip_vision_model" if clip else "siglip_vision_model",
        image_size=32,
        patch_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        projection_dim=32,
    )
    text = tiny_config(tokenizer) | dict(
        model_type="llama",
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default" if clip else "full",
        vision_feature_layer=-2 if clip else -1,
        projector_hidden_act="gelu",
    )
    if weights:
        import torch
        from transformers import LlavaForConditionalGeneration

        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config).eval()
        with torch.no_grad():  # biases and norm weights start at 0 and 1: perturbed, they must really be read
            for param in model.parameters():
                if param.ndim == 1:
                    param.add_(torch.randn_like(param) * 0.2)
        model.save_pretrained(path, safe_serialization=True)
    else:
        (path / "config.json").write_text(json.dumps(config.to_dict()))
    return path


IDEFICS3_TILE_TOKENS = 4  # (32 / 8)^2 patches a tile, folded 2 x 2


def make_idefics3_folder(path: Path, *, weights: bool = False, seed: int = 0) -> Path:
    """A tiny Idefics3 (SmolVLM's architecture) in `path`: images resized to at most 64 pixels a side and cut into
    tiles of 32 (up to 2 x 2, plus the whole image), each tile 4 image tokens; random weights with `weights`."""
    from transformers import Idefics3Config, Idefics3ImageProcessorPil, Idefics3Processor

    tokenizer = make_tokenizer(path, chat_template=IMAGE_CHATML_TEMPLATE)
    tags = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    special = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>", *tags]
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.save_pretrained(path)
    images = Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    processor = Idefics3Processor(
        images, tokenizer, image_seq_len=IDEFICS3_TILE_TOKENS, chat_template=IMAGE_CHATML_TEMPLATE
    )
    processor.save_pretrained(path)
    text = tiny_config(tokenizer) | dict(
        model_type="llama", bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    text["tie_word_embeddings"] = False
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    vision |= dict(image_size=32, patch_size=8)
    config = Idefics3Config(
        vision_config=vision,
        text_config=text,
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
    )
    if weights:
        import torch
        from transformers import Idefics3ForConditionalGeneration

        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(config).eval()
        with torch.no_grad():  # biases and norm weights start at 0 and 1: perturbed, they must really be read
            for param in model.parameters():
                if param.ndim == 1:
                    param.add_(torch.randn_like(param) * 0.2)
        model.save_pretrained(path, safe_serialization=True)
    else:
        (path / "config.json").write_text(json.dumps(config.to_dict()))
    return path


LLAVA_NEXT_PINPOINTS = [[32, 64], [64, 32], [64, 64]]


def make_llava_next_folder(path: Path, *, weights: bool = False, seed: int = 0) -> Path:
    """A tiny LLaVA-NeXT in `path`: LLaVA's CLIP tower on 32-pixel tiles, images fitted to a 1 x 2, 2 x 1 or 2 x 2
    grid of tiles plus the whole image; random weights with `weights`."""
    from transformers import LlavaNextConfig, LlavaNextImageProcessorPil, LlavaNextProcessor

    tokenizer = make_tokenizer(path, chat_template=IMAGE_CHATML_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.save_pretrained(path)
    images = LlavaNextImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, image_grid_pinpoints=LLAVA_NEXT_PINPOINTS
    )
    processor = LlavaNextProcessor(
        images,
        tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=IMAGE_CHATML_TEMPLATE,
    )
    processor.save_pretrained(path)
    vision = dict(model_type="clip_vision_model", image_size=32, patch_size=8, hidden_size=32, intermediate_size=64)
    vision |= dict(num_hidden_layers=2, num_attention_heads=4, projection_dim=32)
    text = tiny_config(tokenizer) | dict(
        model_type="llama", bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    text["tie_word_embeddings"] = False
    config = LlavaNextConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_grid_pinpoints=LLAVA_NEXT_PINPOINTS,
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
    )
    if weights:
        import torch
        from transformers import LlavaNextForConditionalGeneration

        torch.manual_seed(seed)
        model = LlavaNextForConditionalGeneration(config).eval()
        with torch.no_grad():  # biases, norm weights and image_newline: perturbed, they must really be read
            for param in model.parameters():
                if param.ndim == 1:
                    param.add_(torch.randn_like(param) * 0.2)
        model.save_pretrained(path, safe_serialization=True)
    else:
        (path / "config.json").write_text(json.dumps(config.to_dict()))
    return path


QWEN2_VL_CHATML_TEMPLATE = IMAGE_CHATML_TEMPLATE.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")


def make_qwen2_vl_folder(path: Path, *, weights: bool = False, seed: int = 0, kind: str = "qwen2_vl") -> Path:
    """A tiny Qwen2-VL (`kind` "qwen2_vl") or Qwen2.5-VL ("qwen2_5_vl") in `path`: images resized to multiples of 8
    pixels between 16 x 16 and 64 x 64 worth of pixels, patches of 4 merged 2 x 2 (an image of 40 x 30 takes
    8 x 10 patches, 20 image tokens); M-RoPE sections (2, 3, 3) over heads of 16; Qwen2.5-VL's tower attends
    within windows of 16 pixels except in its last block. Random weights with `weights`."""
    from transformers import Qwen2VLImageProcessorPil

    tokenizer = make_tokenizer(path, chat_template=QWEN2_VL_CHATML_TEMPLATE)
    special = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.save_pretrained(path)
    # The image processor alone: Qwen2VLProcessor wants a video processor, which needs torchvision (see
    # `qwen2_vl_inputs` for what the processor does with the text).
    Qwen2VLImageProcessorPil(min_pixels=16 * 16, max_pixels=64 * 64, patch_size=4, merge_size=2).save_pretrained(path)
    text = tiny_config(tokenizer) | dict(bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    vision = dict(depth=2, num_heads=4, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
    vision["initializer_range"] = 0.2
    tokens = dict(image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"), tie_word_embeddings=False)
    tokens["video_token_id"] = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    tokens["vision_start_token_id"] = tokenizer.convert_tokens_to_ids("<|vision_start|>")
    tokens["vision_end_token_id"] = tokenizer.convert_tokens_to_ids("<|vision_end|>")
    if kind == "qwen2_vl":
        from transformers import Qwen2VLConfig as Config
        from transformers import Qwen2VLForConditionalGeneration as Model

        vision |= dict(embed_dim=32, hidden_size=text["hidden_size"], mlp_ratio=2)
    else:
        from transformers import Qwen2_5_VLConfig as Config
        from transformers import Qwen2_5_VLForConditionalGeneration as Model

        vision |= dict(hidden_size=32, out_hidden_size=text["hidden_size"], intermediate_size=48)
        vision |= dict(window_size=16, fullatt_block_indexes=[1])
    config = Config(text_config=text, vision_config=vision, **tokens)
    if weights:
        import torch

        torch.manual_seed(seed)
        model = Model(config).eval()
        with torch.no_grad():  # biases and norm weights start at 0 and 1: perturbed, they must really be read
            for param in model.parameters():
                if param.ndim == 1:
                    param.add_(torch.randn_like(param) * 0.2)
        model.save_pretrained(path, safe_serialization=True)
    else:
        (path / "config.json").write_text(json.dumps(config.to_dict()))
    return path


def qwen2_vl_inputs(folder: Path, text: str, files: list[bytes]) -> dict:
    """What Qwen2VLProcessor makes of `text` and the images in `files`: each `<|image_pad|>` expanded to its image's
    tokens (its patch grid / merge²), the ids, the image processor's pixel values and grids, and the token types
    (1: an image token) that transformers' M-RoPE reads."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer, images = AutoTokenizer.from_pretrained(folder), AutoImageProcessor.from_pretrained(folder)
    pad = "<|image_pad|>"
    inputs = dict(images(images=[Image.open(io.BytesIO(f)) for f in files], return_tensors="pt")) if files else {}
    counts = (inputs["image_grid_thw"].prod(-1) // images.merge_size**2).tolist() if files else []
    pieces = text.split(pad)
    assert len(pieces) == len(counts) + 1, "one <|image_pad|> per image"
    expanded = pieces[0] + "".join(pad * n + piece for n, piece in zip(counts, pieces[1:], strict=True))
    ids = tokenizer(expanded, return_tensors="pt")["input_ids"]
    inputs["input_ids"], inputs["attention_mask"] = ids, torch.ones_like(ids)
    inputs["mm_token_type_ids"] = (ids == tokenizer.convert_tokens_to_ids(pad)).int()
    return inputs


# SigLIP on 32 x 32 images in 8 x 8 patches (Gemma 3's tower, PaliGemma's).
SIGLIP_32 = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
SIGLIP_32 |= dict(image_size=32, patch_size=8)
GEMMA3_IMAGE_TOKENS = 4  # the 4 x 4 patches pooled 2 x 2
GEMMA3_CHAT_TEMPLATE = IMAGE_CHATML_TEMPLATE.replace("<image>", "<start_of_image>")


def make_gemma3_folder(
    path: Path, *, weights: bool = False, seed: int = 0, sliding_window: int = 8, text: dict | None = None
) -> Path:
    """A tiny Gemma 3 (image-text-to-text) in `path` with its tokenizer, processor and chat template: SigLIP's 16
    patches pooled to 4 image tokens between `<start_of_image>` and `<end_of_image>`, a sliding layer (window
    `sliding_window`) then a full one, their RoPE bases apart (`text`: other language model settings); random
    weights with `weights`."""
    from transformers import AutoTokenizer, Gemma3Config, Gemma3ImageProcessorPil, Gemma3Processor

    tokenizer = make_tokenizer(path, chat_template=GEMMA3_CHAT_TEMPLATE)
    names = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer._set_model_specific_special_tokens(special_tokens=names)  # what Gemma 3's tokenizer_config declares
    tokenizer.save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = Gemma3Processor(images, tokenizer, image_seq_length=GEMMA3_IMAGE_TOKENS)
    processor.chat_template = GEMMA3_CHAT_TEMPLATE
    processor.save_pretrained(path)
    settings = tiny_config(tokenizer) | dict(bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    settings |= dict(head_dim=16, sliding_window=sliding_window, layer_types=["sliding_attention", "full_attention"])
    settings |= dict(eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False) | (text or {})
    settings.pop("model_type", None)
    config = Gemma3Config(
        text_config=settings,
        vision_config=SIGLIP_32,
        mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
        image_token_id=tokenizer.image_token_id,
        boi_token_id=tokenizer.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_id=tokenizer.convert_tokens_to_ids("<end_of_image>"),
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    if weights:
        import torch
        from transformers import Gemma3ForConditionalGeneration

        torch.manual_seed(seed)
        model = Gemma3ForConditionalGeneration(config).eval()
        with torch.no_grad():  # biases and norm weights start at 0 and 1: perturbed, they must really be read
            for param in model.parameters():
                if param.ndim == 1:
                    param.add_(torch.randn_like(param) * 0.2)
            # transformers initialises the projection to zeros, which would make every image row 0
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.2)
        model.save_pretrained(path, safe_serialization=True)
    else:
        (path / "config.json").write_text(json.dumps(config.to_dict()))
    return path
