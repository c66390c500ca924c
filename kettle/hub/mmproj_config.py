"""The folder prepared from a language GGUF and its projector (`mmproj`) file becomes a vision-language model's
folder: config.json turns into the family's config (the language model's config as `text_config`, the vision
encoder's from the projector's `clip.vision.*` metadata, the image token ids from the tokenizer), and the image
processor's settings are written (`preprocessor_config.json`, plus `processor_config.json` with what the
router's token counting reads: kettle/router/images/tokens.py) from the projector's image size, mean and std
and the family's own defaults for the rest (its processor's resize rules).

Sizes the metadata states unreliably are read off the tensors instead: llama.cpp's Qwen2-VL converter writes the
language model's width as the encoder's feed-forward length, so every family takes the MLP's width from
`v.blk.0.ffn_*` and the projector's output from its last matrix. Runs in the preparation child (transformers).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kettle.hub.gguf_header import GgufHeader, read_header
from kettle.hub.mmproj import PROJECTOR_TYPE
from kettle.hub.types import PreparationError

VISION = "clip.vision."
# The family defaults the metadata has no key for (transformers' own defaults for the published models).
QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 56 * 56, 28 * 28 * 1280
QWEN_WINDOW = 112  # Qwen2.5-VL's attention window in pixels (every published model's config)
QWEN_MROPE_SECTION = [16, 24, 24]
GEMMA3_POOL = 4  # clip.cpp's pooling kernel for Gemma 3 where the file states none (every published model's)


@dataclass(frozen=True)
class Tower:
    """What the projector file says of its vision encoder, in the names the configs use."""

    header: GgufHeader
    kind: str

    def get(self, key: str, default=None):
        value = self.header.fields.get(VISION + key)
        return default if value is None else value

    @property
    def width(self) -> int:
        return int(self.get("embedding_length"))

    @property
    def depth(self) -> int:
        return int(self.get("block_count"))

    @property
    def heads(self) -> int:
        return int(self.get("attention.head_count"))

    @property
    def eps(self) -> float:
        return float(self.get("attention.layer_norm_epsilon", 1e-6))

    def has(self, name: str) -> bool:
        return any(tensor.name == name for tensor in self.header.tensors)

    def dims(self, name: str) -> tuple[int, ...]:
        return next(tensor.dims for tensor in self.header.tensors if tensor.name == name)

    @property
    def ffn(self) -> int:
        """The MLP's inner width: the dimension of layer 0's up (or, under the older names, down) matrix that is
        not the encoder's width."""
        inner, outer = self.dims("v.blk.0.ffn_up.weight")
        return outer if inner == self.width else inner

    @property
    def mean_std(self) -> dict:
        return {"image_mean": list(self.get("image_mean")), "image_std": list(self.get("image_std"))}

    def common(self) -> dict:
        """The settings every family's vision config has, under Hugging Face's usual names."""
        return dict(
            hidden_size=self.width,
            intermediate_size=self.ffn,
            num_hidden_layers=self.depth,
            num_attention_heads=self.heads,
            image_size=int(self.get("image_size")),
            patch_size=int(self.get("patch_size")),
            layer_norm_eps=self.eps,
        )


def write_vision_config(language: Path, mmproj: Path, out_dir: Path) -> None:
    """Rewrites `out_dir`'s config.json (the language model's, prepared from `language`) as the vision-language
    model's, and writes its image processor's settings."""
    from transformers import AutoTokenizer

    header = read_header(mmproj)
    tower = Tower(header, str(header.fields.get(PROJECTOR_TYPE)))
    text = json.loads((out_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    config, images, processor = FAMILIES[tower.kind](tower, text, _ids(tokenizer), read_header(language).fields)
    config.save_pretrained(out_dir)
    images.save_pretrained(out_dir)
    (out_dir / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")


def _ids(tokenizer) -> Callable[[str], int]:
    """A token's id in the model's vocabulary; a `PreparationError` when the tokenizer lacks it (the family puts
    the image's rows at that token)."""

    def token_id(token: str) -> int:
        found = tokenizer.convert_tokens_to_ids(token)
        if found is None or found == tokenizer.unk_token_id:
            raise PreparationError(
                f"Cannot serve images: the model's tokenizer has no {token!r} token, which the vision family "
                "places image features at; pass the language model the projector was published with"
            )
        return found

    return token_id


def _text(text: dict) -> dict:
    """The language model's config as a sub-config: what names the outer model leaves out."""
    return {key: value for key, value in text.items() if key not in ("architectures", "transformers_version")}


def _llava(tower: Tower, text: dict, token_id, language: dict):
    """LLaVA (`mlp`): a CLIP tower (its class token dropped, LLaVA's `default` strategy) or a SigLIP one (every
    patch). llama.cpp's LLaVA files hold only the layers that run: the features come from `feature_layer`
    when set, else from the layer before the file's last (llama.cpp's rule)."""
    from transformers import CLIPImageProcessorPil, LlavaConfig, SiglipImageProcessorPil

    if tower.has("v.image_newline") or tower.get("image_grid_pinpoints") is not None:
        raise PreparationError("Cannot serve images: this mlp projector is LLaVA-NeXT's (a grid of tiles), not served")
    layers = tower.get("feature_layer")
    if isinstance(layers, list) and len(layers) > 1:
        raise PreparationError(f"Cannot serve images: features from several layers ({layers}) are not served")
    clip = tower.has("v.class_embd")
    vision = tower.common() | {
        "model_type": "clip_vision_model" if clip else "siglip_vision_model",
        "hidden_act": ("gelu" if clip else "gelu_pytorch_tanh") if tower.get("use_gelu") else "quick_gelu",
        "projection_dim": int(tower.get("projection_dim", text["hidden_size"])),
    }
    strategy = "default" if clip else "full"
    config = LlavaConfig(
        vision_config=vision,
        text_config=_text(text),
        image_token_index=token_id("<image>"),
        vision_feature_select_strategy=strategy,
        vision_feature_layer=int(layers[0]) if layers else tower.depth - 1,
        projector_hidden_act="gelu",
    )
    side = vision["image_size"]
    if clip:
        size = {"size": {"shortest_edge": side}, "crop_size": {"height": side, "width": side}}
        images = CLIPImageProcessorPil(**size, **tower.mean_std)
    else:
        images = SiglipImageProcessorPil(size={"height": side, "width": side}, **tower.mean_std)
    processor = {
        "processor_class": "LlavaProcessor",
        "image_token": "<image>",
        "patch_size": vision["patch_size"],
        "vision_feature_select_strategy": strategy,
        "num_additional_image_tokens": 1 if clip else 0,
    }
    return config, images, processor


def _idefics3(tower: Tower, text: dict, token_id, language: dict):
    """Idefics3 / SmolVLM: a SigLIP tower on tiles of `image_size`, the image's longest side resized to
    `preproc_image_size` (4 tiles by default, the processor's own), patches folded by `scale_factor`."""
    from transformers import Idefics3Config, Idefics3ImageProcessorPil

    scale = int(tower.get("projector.scale_factor", 2))
    vision = tower.common() | {"hidden_act": "gelu_pytorch_tanh"}
    config = Idefics3Config(
        vision_config=vision,
        text_config=_text(text),
        scale_factor=scale,
        image_token_id=token_id("<image>"),
        tie_word_embeddings=text.get("tie_word_embeddings", False),
    )
    side, patch = vision["image_size"], vision["patch_size"]
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": int(tower.get("preproc_image_size", 4 * side))},
        max_image_size={"longest_edge": side},
        **tower.mean_std,
    )
    processor = {"processor_class": "Idefics3Processor", "image_seq_len": (side // patch) ** 2 // scale**2}
    return config, images, processor


def _gemma3(tower: Tower, text: dict, token_id, language: dict):
    """Gemma 3: a SigLIP tower on square images of `image_size` (pan-and-scan off, the processor's default), its
    patch grid pooled by `scale_factor` (clip.cpp's default 4 where the converter wrote none: 896 / 14 / 4 = 64 →
    256 image tokens), the soft tokens between `<start_of_image>` and `<end_of_image>`."""
    from transformers import Gemma3Config, Gemma3ImageProcessorPil

    scale = int(tower.get("projector.scale_factor", GEMMA3_POOL))
    vision = tower.common() | {"model_type": "siglip_vision_model", "hidden_act": "gelu_pytorch_tanh"}
    vision["vision_use_head"] = False  # as Gemma 3's own config: the file holds no pooling head
    side, patch = vision["image_size"], vision["patch_size"]
    tokens = (side // patch // scale) ** 2
    config = Gemma3Config(
        text_config=_text(text),
        vision_config=vision,
        mm_tokens_per_image=tokens,
        image_token_index=token_id("<image_soft_token>"),
        boi_token_index=token_id("<start_of_image>"),
        eoi_token_index=token_id("<end_of_image>"),
        tie_word_embeddings=text.get("tie_word_embeddings", True),
    )
    images = Gemma3ImageProcessorPil(size={"height": side, "width": side}, **tower.mean_std)
    processor = {"processor_class": "Gemma3Processor", "image_seq_length": tokens}
    return config, images, processor


def _qwen2_vl(tower: Tower, text: dict, token_id, language: dict):
    """Qwen2-VL and Qwen2.5-VL: the merger's output width from `mm.2`, Qwen2.5-VL's full-attention blocks from
    `n_wa_pattern` (every n-th block, llama.cpp's rule), the language model's M-RoPE sections from its file."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen2VLImageProcessorPil

    merge = int(tower.get("spatial_merge_size", 2))
    out = tower.dims("mm.2.weight")[1]
    vision = dict(
        depth=tower.depth,
        num_heads=tower.heads,
        patch_size=int(tower.get("patch_size")),
        spatial_merge_size=merge,
        temporal_patch_size=2,
        in_channels=3,
    )
    if tower.kind == "qwen2.5vl_merger":
        every = int(tower.get("n_wa_pattern", 0))
        full = [i for i in range(tower.depth) if every and (i + 1) % every == 0]
        vision |= dict(hidden_size=tower.width, out_hidden_size=out, intermediate_size=tower.ffn, hidden_act="silu")
        vision |= dict(window_size=int(tower.get("window_size", QWEN_WINDOW)), fullatt_block_indexes=full)
        kind = Qwen2_5_VLConfig
    else:
        vision |= dict(embed_dim=tower.width, hidden_size=out, mlp_ratio=tower.ffn // tower.width)  # 4 in Qwen2-VL
        vision |= dict(hidden_act="quick_gelu")
        kind = Qwen2VLConfig
    sections = language.get(f"{language.get('general.architecture')}.rope.dimension_sections")
    text = {k: v for k, v in _text(text).items() if k != "model_type"}  # the family's own text config class
    rope = dict(text.get("rope_parameters") or {"rope_type": "default", "rope_theta": text.get("rope_theta", 1e6)})
    text["rope_parameters"] = rope | {"mrope_section": list(sections[:3]) if sections else QWEN_MROPE_SECTION}
    config = kind(
        text_config=text,
        vision_config=vision,
        image_token_id=token_id("<|image_pad|>"),
        video_token_id=token_id("<|video_pad|>"),
        vision_start_token_id=token_id("<|vision_start|>"),
        vision_end_token_id=token_id("<|vision_end|>"),
        tie_word_embeddings=text.get("tie_word_embeddings", False),
    )
    images = Qwen2VLImageProcessorPil(
        min_pixels=int(tower.get("image_min_pixels", QWEN_MIN_PIXELS)),
        max_pixels=int(tower.get("image_max_pixels", QWEN_MAX_PIXELS)),
        patch_size=vision["patch_size"],
        merge_size=merge,
        **tower.mean_std,
    )
    return config, images, {"processor_class": "Qwen2VLProcessor"}


FAMILIES: dict[str, Callable] = {
    "mlp": _llava,
    "idefics3": _idefics3,
    "gemma3": _gemma3,
    "qwen2vl_merger": _qwen2_vl,
    "qwen2.5vl_merger": _qwen2_vl,
}
