"""Facts several families read the same way from a transformers config: RoPE settings and sliding windows."""

from __future__ import annotations


def rope_parameters(config) -> dict:
    """RoPE settings from a transformers config: v5's `rope_parameters`, or v4's `rope_theta` + `rope_scaling`."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


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
