"""Reading a model's config, and facts several families read the same way from it: RoPE settings and sliding
windows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def rope_parameters(config) -> dict:
    """RoPE settings from a transformers config: v5's `rope_parameters`, or v4's `rope_theta` + `rope_scaling`."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def layer_rope_parameters(config) -> dict | list[dict]:
    """`rope_parameters`, or each layer's where the config keys them by layer type (transformers 5's Gemma 3:
    `{"sliding_attention": {...}, "full_attention": {...}}` beside `layer_types`)."""
    params = rope_parameters(config)
    layer_types = getattr(config, "layer_types", None)
    if not layer_types or not all(isinstance(params.get(kind), dict) for kind in set(layer_types)):
        return params
    return [dict(params[kind]) for kind in layer_types]


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding window: everywhere when `sliding_window` is set without `layer_types` (Mistral),
    else where `layer_types` say (Qwen2, Qwen3); Llama configs carry the field but never use it."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or config.model_type == "llama":
        return [None] * config.num_hidden_layers
    if layer_types is None:
        return [window] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in layer_types]


# The native model types whose config.json, once written by transformers 5, reads back attribute for attribute
# as transformers' config class loads it (tests/unit/test_hf_config.py compares every attribute Kettle reads),
# each with its class's `attribute_map` (GPT-2's n_embd answers to hidden_size, and so on). MPT (a nested
# attention config object) and Falcon (head_dim and rotary are computed properties) are not among them.
_GPT2_NAMES = {
    "hidden_size": "n_embd",
    "max_position_embeddings": "n_positions",
    "num_attention_heads": "n_head",
    "num_hidden_layers": "n_layer",
}
JSON_CONFIGS: dict[str, dict[str, str]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "mixtral": {"num_experts": "num_local_experts"},
    "gemma": {},
    "gemma2": {},
    "gemma3_text": {},
    "phi": {},
    "phi3": {},
    "starcoder2": {},
    "gpt_neox": {},
    "gptj": _GPT2_NAMES,
    "opt": {},
    "gpt2": _GPT2_NAMES,
    "gpt_bigcode": _GPT2_NAMES,
    "bloom": {"num_hidden_layers": "n_layer", "num_attention_heads": "n_head"},
}
# What every transformers config has beyond its file: `rope_scaling` is transformers 5's name for the older
# RoPE field (`rope_parameters` now), and the base class defaults of the attributes a file may leave out.
_BASE_NAMES = {"rope_scaling": "rope_parameters"}
_BASE_DEFAULTS: dict[str, Any] = {"is_encoder_decoder": False, "dtype": None}


class JsonConfig:
    """config.json's values as attributes, standing in for a transformers config on the native path: importing
    transformers' AutoConfig costs the shard ~100 MB resident and ~1.6 s (it loads torch._dynamo and
    torch._inductor on the way)."""

    def __init__(self, values: dict[str, Any], attribute_map: dict[str, str]) -> None:
        object.__setattr__(self, "_attribute_map", {**_BASE_NAMES, **attribute_map})
        self.__dict__.update(_BASE_DEFAULTS)
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:  # only for names not set: the aliases
        target = self._attribute_map.get(name)
        if target is None:
            raise AttributeError(name)
        return getattr(self, target)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, self._attribute_map.get(name, name), value)


def read_json_config(path: str | Path) -> JsonConfig | None:
    """The folder's config.json as a `JsonConfig` where that reads exactly as transformers' class (see
    `JSON_CONFIGS`): a known native type, written by transformers 5 (older files are normalized on load, RoPE
    settings first), no custom code; else None."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return None
    values = json.loads(file.read_text())
    attribute_map = JSON_CONFIGS.get(values.get("model_type"))
    major = str(values.get("transformers_version", "0")).split(".")[0]
    if attribute_map is None or not major.isdigit() or int(major) < 5 or "auto_map" in values:
        return None
    return JsonConfig(values, attribute_map)


def load_config(path: str, trust_remote_code: bool = False) -> Any:
    """The model's config: `read_json_config`'s where it applies, else transformers' AutoConfig (imported only
    then: the transformers fallback, encoder-decoders, other native families and older files)."""
    config = read_json_config(path)
    if config is not None:
        return config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
