"""A tiny vision-language model folder (tests/vision_fixtures.py) written as llama.cpp publishes such models: the
language model's GGUF (its text model, F32, with the tokenizer as llama.cpp's converter stores it) and a projector
file `mmproj-*.gguf` (architecture `clip`, `v.*` and `mm.*` tensors, `clip.vision.*` metadata).

The projector follows the converter that writes each family's published files, transforms included:
- LLaVA: the older convert_image_encoder_to_gguf.py (the one llama.cpp's LLaVA-1.5 projectors come from): the
  layers after the feature layer dropped, the final norm dropped, fc1 named `ffn_down` and fc2 `ffn_up`, the
  patch kernel in F16 (`feature_layer` non-negative);
- Idefics3 / SmolVLM, Gemma 3 and Qwen2-VL / Qwen2.5-VL: convert_hf_to_gguf.py's MmprojModel classes, names from
  gguf's own `TensorNameMap`, Gemma 3's projector norm stored as 1 + w and its projection matrix in F16, Qwen's
  fused qkv split into q, k and v and its Conv3d patch kernel split into two frames.
Qwen2.5-VL's window (which published files leave to llama.cpp's default, the models' 112 pixels) is written as
`clip.vision.window_size`, since the tiny model's is 16.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tests.gguf_files import gemma3_metadata, gguf_names, to_gguf

# Where each family keeps its language model, in transformers 5's layout.
TEXT_PREFIXES = ("model.text_model.", "model.language_model.")


def text_state(model) -> dict[str, torch.Tensor]:
    """The language model's tensors under the text family's names (`model.layers.0...`, `lm_head.weight`)."""
    state = {}
    for name, tensor in model.state_dict().items():
        for prefix in TEXT_PREFIXES:
            if name.startswith(prefix):
                state["model." + name[len(prefix) :]] = tensor
        if name == "lm_head.weight":
            state[name] = tensor
    return state


def write_language_gguf(model, folder: Path, path: Path, arch: str) -> Path:
    """The text model of `model` (its tokenizer in `folder`) as llama.cpp's converter writes it, all F32."""
    import gguf

    text = model.config.text_config
    tied = bool(getattr(model.config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))
    writer = gguf.GGUFWriter(path, arch)
    _text_metadata(writer, arch, text)
    _tokenizer_metadata(writer, folder)
    names = gguf_names(arch, text.num_hidden_layers)
    for name, tensor in text_state(model).items():
        if name == "lm_head.weight" and tied:
            continue
        data = to_gguf(arch, name, tensor.float().numpy(), text)  # Llama's q/k permutation, Gemma's 1 + w norms
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(data))
    _finish(writer)
    return path


def _text_metadata(writer, arch: str, text) -> None:
    writer.add_block_count(text.num_hidden_layers)
    writer.add_context_length(text.max_position_embeddings)
    writer.add_embedding_length(text.hidden_size)
    writer.add_feed_forward_length(text.intermediate_size)
    writer.add_head_count(text.num_attention_heads)
    writer.add_head_count_kv(text.num_key_value_heads)
    writer.add_layer_norm_rms_eps(text.rms_norm_eps)
    if arch == "gemma3":  # its RoPE keys (and head size, window) are its own
        gemma3_metadata(writer, text)
        return
    rope = text.rope_parameters or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    if arch == "llama":
        writer.add_rope_dimension_count(text.hidden_size // text.num_attention_heads)
    if "mrope_section" in rope:  # llama.cpp pads the sections to four
        writer.add_rope_dimension_sections([*rope["mrope_section"], 0])


def _tokenizer_metadata(writer, folder: Path) -> None:
    """The byte-level BPE of `folder`'s tokenizer.json under llama.cpp's keys: its special tokens as control tokens."""
    import gguf

    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(spec["model"]["vocab"])
    added = {token["id"]: token for token in spec["added_tokens"]}
    vocab |= {token["content"]: index for index, token in added.items()}
    tokens = [""] * (max(vocab.values()) + 1)
    for token, index in vocab.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    config = json.loads((folder / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    control, normal = gguf.TokenType.CONTROL, gguf.TokenType.NORMAL
    writer.add_token_types([control if added.get(i, {}).get("special") else normal for i in range(len(tokens))])
    writer.add_token_merges(merges)
    special = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id, "pad": writer.add_pad_token_id}
    for kind, add in special.items():
        if config.get(f"{kind}_token"):
            add(vocab[config[f"{kind}_token"]])
    writer.add_add_bos_token(False)
    template = (folder / "chat_template.jinja").read_text() if (folder / "chat_template.jinja").exists() else None
    writer.add_chat_template(template or config["chat_template"])


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _vision_metadata(writer, kind: str, vision: dict, preprocessor: dict, text_width: int) -> None:
    """What MmprojModel.set_gguf_parameters writes for every family."""
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(kind)
    writer.add_vision_projection_dim(text_width)
    writer.add_vision_image_size(vision.get("image_size", 560))
    writer.add_vision_patch_size(vision["patch_size"])
    writer.add_vision_embedding_length(vision["hidden_size"])
    writer.add_vision_feed_forward_length(vision["intermediate_size"])
    writer.add_vision_block_count(vision["num_hidden_layers"])
    writer.add_vision_head_count(vision["num_attention_heads"])
    writer.add_vision_image_mean(preprocessor["image_mean"])
    writer.add_vision_image_std(preprocessor["image_std"])


def _preprocessor(folder: Path) -> dict:
    found = folder / "preprocessor_config.json"
    if found.exists():
        return json.loads(found.read_text())
    return json.loads((folder / "processor_config.json").read_text())["image_processor"]


def write_mmproj(model, folder: Path, path: Path, kind: str) -> Path:
    """The vision tower and projector of `model` (a tiny LLaVA, Idefics3 or Qwen2(.5)-VL saved in `folder`) as the
    projector file llama.cpp publishes for it; `kind` its `clip.projector_type`."""
    import gguf

    writer = gguf.GGUFWriter(path, "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    write = {"mlp": _llava, "idefics3": _idefics3, "gemma3": _gemma3}.get(kind, _qwen)  # else Qwen's two mergers
    write(writer, model, _preprocessor(folder), kind)
    _finish(writer)
    return path


def _llava(writer, model, preprocessor: dict, kind: str) -> None:
    """convert_image_encoder_to_gguf.py with --llava-projector: the layers up to the feature layer, legacy names."""
    config = model.config
    vision = config.vision_config.to_dict()
    depth = vision["num_hidden_layers"]
    layer = config.vision_feature_layer if config.vision_feature_layer >= 0 else depth + 1 + config.vision_feature_layer
    _vision_metadata(writer, kind, vision | {"num_hidden_layers": layer}, preprocessor, vision["projection_dim"])
    writer.add_vision_attention_layernorm_eps(vision["layer_norm_eps"])
    writer.add_vision_use_gelu(vision["hidden_act"] == "gelu")
    writer.add_array("clip.vision.feature_layer", [layer])
    writer.add_bool("clip.has_llava_projector", True)
    for name, tensor in model.state_dict().items():
        stored = _legacy_name(name, layer)
        if stored is not None:
            data = tensor.float().numpy()
            writer.add_tensor(stored, data.astype(np.float16) if data.ndim == 4 else data)


def _legacy_name(name: str, layers: int) -> str | None:
    """The older converter's name for a LLaVA tensor (None: not written)."""
    if name.startswith("model.multi_modal_projector."):
        return name.replace("model.multi_modal_projector.linear_1", "mm.0").replace(
            "model.multi_modal_projector.linear_2", "mm.2"
        )
    prefix = "model.vision_tower."  # transformers 5's layout (no `vision_model.` inside the tower)
    if not name.startswith(prefix) or "post_layernorm" in name or "position_ids" in name:
        return None
    rest = name[len(prefix) :].removeprefix("vision_model.")
    if rest.startswith("encoder.layers.") and int(rest.split(".")[2]) >= layers:
        return None
    renames = [("encoder.layers", "blk"), ("embeddings.", ""), ("_proj", ""), ("self_attn.", "attn_")]
    renames += [("layer_norm", "ln"), ("mlp.fc1", "ffn_down"), ("mlp.fc2", "ffn_up"), ("embedding", "embd")]
    renames += [("pre_layrnorm", "pre_ln")]
    for old, new in renames:
        rest = rest.replace(old, new)
    return "v." + rest


def _idefics3(writer, model, preprocessor: dict, kind: str) -> None:
    """SmolVLMModel: gguf's name map, the embeddings in F32."""
    import gguf

    config = model.config
    vision = config.vision_config.to_dict()
    _vision_metadata(writer, kind, vision, preprocessor, config.text_config.hidden_size)
    writer.add_vision_attention_layernorm_eps(vision["layer_norm_eps"])
    writer.add_vision_projector_scale_factor(config.scale_factor)
    writer.add_vision_use_gelu(True)
    writer.add_vision_preproc_image_size(preprocessor["size"]["longest_edge"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["num_hidden_layers"])
    for name, tensor in model.state_dict().items():
        if name.startswith(("model.vision_model.", "model.connector.")):
            stored = names.get_name(name, try_suffixes=(".weight", ".bias"))
            writer.add_tensor(stored, np.ascontiguousarray(tensor.float().numpy()))


def _gemma3(writer, model, preprocessor: dict, kind: str) -> None:
    """Gemma3VisionModel: the checkpoint's names (`vision_tower.vision_model.*`) through gguf's name map, SigLIP's
    attention-pooling head left out, the pooling written only where it is not clip.cpp's default 4, the projector's
    norm stored as 1 + w and its matrix forced to F16 (the embeddings stay F32)."""
    import gguf

    config = model.config
    vision = config.vision_config.to_dict()
    _vision_metadata(writer, kind, vision, preprocessor, config.text_config.hidden_size)
    writer.add_vision_attention_layernorm_eps(vision["layer_norm_eps"])
    writer.add_vision_use_gelu(True)
    scale = vision["image_size"] // vision["patch_size"] // int(config.mm_tokens_per_image**0.5)
    if scale != 4:
        writer.add_vision_projector_scale_factor(scale)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["num_hidden_layers"])
    for name, tensor in model.state_dict().items():
        name, data = name.removeprefix("model."), tensor.float().numpy()
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.head."):
            name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
        elif name.startswith("multi_modal_projector."):
            name = name.replace("_weight", ".weight")
            data = data + 1 if "soft_emb_norm" in name else data.astype(np.float16)
        else:
            continue
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(data))


def _qwen(writer, model, preprocessor: dict, kind: str) -> None:
    """Qwen2VLVisionModel: the config's names renamed as the converter renames them, qkv split, the Conv3d patch
    kernel split into its two frames."""
    import gguf

    config = model.config
    vision = config.vision_config.to_dict()
    vision |= {"num_attention_heads": vision["num_heads"], "num_hidden_layers": vision["depth"]}
    if "embed_dim" in vision:  # Qwen2-VL: the converter's own renaming (its feed-forward length is then wrong)
        vision |= {"intermediate_size": vision["hidden_size"], "hidden_size": vision["embed_dim"]}
    _vision_metadata(writer, kind, vision, preprocessor, config.text_config.hidden_size)
    if kind == "qwen2.5vl_merger":
        writer.add_vision_use_silu(True)
        writer.add_vision_n_wa_pattern(vision["fullatt_block_indexes"][0] + 1)
        writer.add_vision_window_size(vision["window_size"])
    writer.add_vision_attention_layernorm_eps(config.text_config.rms_norm_eps)
    # The map's block numbers run to the block count: a larger count lets `merger.mlp.2` map on a 2-block tower.
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, 64)
    for name, tensor in model.state_dict().items():
        if not name.startswith("model.visual."):
            continue
        name, data = name.removeprefix("model."), tensor.float().numpy()
        if name == "visual.patch_embed.proj.weight":
            writer.add_tensor("v.patch_embd.weight", np.ascontiguousarray(data[:, :, 0]))
            writer.add_tensor("v.patch_embd.weight.1", np.ascontiguousarray(data[:, :, 1]))
        elif ".qkv." in name:
            for part, rows in zip("qkv", np.split(data, 3), strict=True):
                stored = names.get_name(name.replace("qkv", part), try_suffixes=(".weight", ".bias"))
                writer.add_tensor(stored, np.ascontiguousarray(rows))
        else:
            writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(data))


def write_pair(model, folder: Path, out: Path, arch: str, kind: str) -> tuple[Path, Path]:
    """Both files into `out`, named as llama.cpp's repositories name them."""
    out.mkdir(parents=True, exist_ok=True)
    language = write_language_gguf(model, folder, out / "tiny-vlm-F32.gguf", arch)
    return language, write_mmproj(model, folder, out / "mmproj-tiny-vlm-f16.gguf", kind)
