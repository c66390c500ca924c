"""How many image tokens an image takes, and the text that stands for it in the prompt, per family.

Read from the model folder's `config.json`, `processor_config.json` and `preprocessor_config.json` alone (no
transformers processor, no torch), with the processors' own arithmetic, so the router's token ids are the ones
transformers' processor would make. `for_model` returns None for a model that takes no images.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ImageTokens:
    """A family's way of writing an image into its prompt.

    `marker` is what its chat template writes for one image (replaced by `expand`); a Markdown image of
    `/generate` becomes `markdown`. `image_token` is the token that stands for one embedding row: the shard puts
    the image's embeddings at those positions.
    """

    model_type: str
    marker: str
    image_token: str
    image_token_id: int
    count: Callable[[int, int], int]  # (width, height) -> image tokens
    before: str = ""  # around the run of image tokens, in `expand`
    after: str = ""
    markdown_before: str = ""  # around `expand`, for a Markdown image (what the chat template adds itself)
    markdown_after: str = ""
    # The whole text of an image, for families whose image tokens are not one run (Idefics3's tiles); None: the
    # run of `count` image tokens between `before` and `after`.
    layout: Callable[[int, int], str] | None = None
    # The model attends an image's tokens to each other both ways (Gemma 3): a prefill chunk never ends inside one.
    whole: bool = False

    def expand(self, width: int, height: int) -> str:
        if self.layout is not None:
            return self.layout(width, height)
        return self.before + self.image_token * self.count(width, height) + self.after

    def markdown(self, width: int, height: int) -> str:
        return self.markdown_before + self.expand(width, height) + self.markdown_after


def for_model(folder: str | Path) -> ImageTokens | None:
    """The image tokens of the model in `folder`, or None when it takes no images (or none Kettle knows)."""
    folder = Path(folder)
    config = _read(folder / "config.json")
    if "vision_config" not in config:
        return None
    build = FAMILIES.get(config.get("model_type", ""))
    if build is None:
        return None
    processor = _read(folder / "processor_config.json")
    # transformers 5 writes the image processor's settings inside processor_config.json; older folders beside it.
    preprocessor = _read(folder / "preprocessor_config.json") or processor.get("image_processor", {})
    return build(config, processor, preprocessor)


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def _size(value: Any, default: int) -> tuple[int, int]:
    """(height, width) of an image processor's `crop_size` / `size` ({height, width}, {shortest_edge} or an int)."""
    if isinstance(value, int):
        return value, value
    if isinstance(value, dict):
        if "height" in value:
            return int(value["height"]), int(value["width"])
        if "shortest_edge" in value:
            return int(value["shortest_edge"]), int(value["shortest_edge"])
    return default, default


def _llava(config: dict, processor: dict, preprocessor: dict) -> ImageTokens:
    """LlavaProcessor: (crop height / patch) x (crop width / patch) + the additional tokens (CLIP's class token),
    less one under the `default` feature strategy (which drops it); the same for every image."""
    vision = config["vision_config"]
    patch = processor.get("patch_size") or vision.get("patch_size", 14)
    height, width = _size(preprocessor.get("crop_size") or preprocessor.get("size"), vision.get("image_size", 336))
    n = (height // patch) * (width // patch) + processor.get("num_additional_image_tokens", 0)
    strategy = processor.get("vision_feature_select_strategy") or config.get("vision_feature_select_strategy")
    if strategy == "default":
        n -= 1
    token = processor.get("image_token", "<image>")
    token_id = config.get("image_token_id", config.get("image_token_index", 32000))
    return ImageTokens("llava", token, token, token_id, lambda w, h: n)


def best_resolution(height: int, width: int, pinpoints: list) -> tuple[int, int]:
    """The (height, width) of `pinpoints` that keeps most of the image and wastes least (transformers'
    select_best_resolution)."""
    best, most, waste = None, 0, float("inf")
    for target_h, target_w in pinpoints:
        scale = min(target_w / width, target_h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = target_w * target_h - effective
        if effective > most or (effective == most and wasted < waste):
            best, most, waste = (target_h, target_w), effective, wasted
    return best


def _llava_next(config: dict, processor: dict, preprocessor: dict) -> ImageTokens:
    """LlavaNextProcessor: the base tile's patches (+ the class token unless dropped), then the best grid's
    patches with the padding rows or columns taken off and one newline feature per row."""
    vision = config["vision_config"]
    patch = processor.get("patch_size") or vision.get("patch_size", 14)
    height, width = _size(preprocessor.get("crop_size") or preprocessor.get("size"), vision.get("image_size", 336))
    pinpoints = preprocessor.get("image_grid_pinpoints") or config.get("image_grid_pinpoints")
    extra = processor.get("num_additional_image_tokens", 0)
    strategy = processor.get("vision_feature_select_strategy") or config.get("vision_feature_select_strategy")

    def count(image_width: int, image_height: int) -> int:
        best_h, best_w = best_resolution(image_height, image_width, pinpoints)
        rows, cols = height // patch, width // patch
        current_h, current_w = rows * (best_h // height), cols * (best_w // width)
        if image_width / image_height > current_w / current_h:
            new_height = int(round(image_height * (current_w / image_width), 7))
            current_h -= (current_h - new_height) // 2 * 2
        else:
            new_width = int(round(image_width * (current_h / image_height), 7))
            current_w -= (current_w - new_width) // 2 * 2
        n = current_h * current_w + current_h + rows * cols + extra
        return n - 1 if strategy == "default" else n

    token = processor.get("image_token", "<image>")
    token_id = config.get("image_token_id", config.get("image_token_index", 32000))
    return ImageTokens("llava_next", token, token, token_id, count)


def _gemma3(config: dict, processor: dict, preprocessor: dict) -> ImageTokens:
    """Gemma3Processor: the template's `<start_of_image>` becomes a fixed run of soft tokens between the begin and
    end tokens, with blank lines around (pan-and-scan off, its default)."""
    n = processor.get("image_seq_length") or config.get("mm_tokens_per_image", 256)
    return ImageTokens(
        "gemma3",
        "<start_of_image>",
        "<image_soft_token>",
        config.get("image_token_id", config.get("image_token_index", 262144)),
        lambda w, h: n,
        before="\n\n<start_of_image>",
        after="<end_of_image>\n\n",
        whole=True,
    )


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize: both sides multiples of `factor`, the area within [min_pixels, max_pixels], the aspect
    ratio kept as closely as that allows (transformers' qwen2_vl smart_resize)."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _qwen2_vl(config: dict, processor: dict, preprocessor: dict) -> ImageTokens:
    """Qwen2VLProcessor: the image resized to multiples of patch x merge, one token per merged patch; the chat
    template writes the begin and end tokens around the `<|image_pad|>` it expands."""
    patch = preprocessor.get("patch_size", 14)
    merge = preprocessor.get("merge_size", 2)
    size = preprocessor.get("size") or {}
    lowest = preprocessor.get("min_pixels") or size.get("shortest_edge", 56 * 56)
    highest = preprocessor.get("max_pixels") or size.get("longest_edge", 28 * 28 * 1280)

    def count(width: int, height: int) -> int:
        h, w = smart_resize(height, width, patch * merge, lowest, highest)
        return (h // patch) * (w // patch) // (merge * merge)

    return ImageTokens(
        config.get("model_type", "qwen2_vl"),
        "<|image_pad|>",
        "<|image_pad|>",
        config.get("image_token_id", 151655),
        count,
        markdown_before="<|vision_start|>",
        markdown_after="<|vision_end|>",
    )


# Idefics3's absolute bound on a resized image's side (transformers' MAX_IMAGE_SIZE).
_IDEFICS3_MAX_SIDE = 4096


def idefics3_grid(width: int, height: int, longest_edge: int, tile: int) -> tuple[int, int]:
    """(rows, columns) of tiles Idefics3's image processor cuts an image into ((0, 0): the image is one tile):
    the longest side resized to `longest_edge` (even shorter side), kept under 4096, then both sides rounded up
    to multiples of `tile` (transformers' idefics3 resize, resize_for_vision_encoder and split_images)."""
    ratio = width / height
    if width >= height:
        width, height = longest_edge, int(longest_edge / ratio)
        height += height % 2
    else:
        height, width = longest_edge, int(longest_edge * ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    ratio = width / height
    if width >= height and width > _IDEFICS3_MAX_SIDE:
        width, height = _IDEFICS3_MAX_SIDE, int(_IDEFICS3_MAX_SIDE / ratio)
    elif height > width and height > _IDEFICS3_MAX_SIDE:
        height, width = _IDEFICS3_MAX_SIDE, int(_IDEFICS3_MAX_SIDE * ratio)
    height, width = max(height, 1), max(width, 1)
    ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / ratio) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * ratio) / tile) * tile
    if height > tile or width > tile:
        return (height - tile) // tile + 1, (width - tile) // tile + 1
    return 0, 0


def _idefics3(config: dict, processor: dict, preprocessor: dict) -> ImageTokens:
    """Idefics3Processor (SmolVLM): a tile grid, each tile `image_seq_len` image tokens after a fake token and its
    `<row_r_col_c>` tag, a newline after each row, then the whole image resized to one tile (`<global-img>`)."""
    seq = processor.get("image_seq_len", 169)
    splitting = preprocessor.get("do_image_splitting", True)
    longest = (preprocessor.get("size") or {}).get("longest_edge", 4 * 364)
    tile = (preprocessor.get("max_image_size") or {}).get("longest_edge", 364)
    fake, image, run = "<fake_token_around_image>", "<image>", "<image>" * seq

    def grid(width: int, height: int) -> tuple[int, int]:
        return idefics3_grid(width, height, longest, tile) if splitting else (0, 0)

    def count(width: int, height: int) -> int:
        rows, cols = grid(width, height)
        return (rows * cols + 1) * seq

    def layout(width: int, height: int) -> str:
        rows, cols = grid(width, height)
        whole = f"{fake}<global-img>{run}{fake}"
        if rows == cols == 0:
            return whole
        lines = "".join(
            "".join(f"{fake}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n" for r in range(rows)
        )
        return f"{lines}\n{whole}"

    token_id = config.get("image_token_id", config.get("image_token_index", 128257))
    return ImageTokens("idefics3", image, image, token_id, count, layout=layout)


FAMILIES: dict[str, Callable[[dict, dict, dict], ImageTokens]] = {
    "idefics3": _idefics3,
    "llava": _llava,
    "llava_next": _llava_next,
    "gemma3": _gemma3,
    "qwen2_vl": _qwen2_vl,
    "qwen2_5_vl": _qwen2_vl,
}
