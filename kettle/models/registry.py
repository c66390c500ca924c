"""From a checkpoint folder to a loaded model: reads config.json and picks the implementation by model_type."""

from __future__ import annotations

from typing import Protocol

import torch

from kettle.layers.attention import AttentionMetadata
from kettle.models.spec import ModelSpec
from kettle.shard.kv_cache import KVCache


class CausalLM(Protocol):
    """What the shard needs from any model: its spec, a paged forward, and logits for chosen rows."""

    spec: ModelSpec

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def _llama(path: str, config, dtype: torch.dtype, device: torch.device) -> CausalLM:
    from kettle.models.llama import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, config, dtype, device)


# model_type → loader. Loaders import their module lazily, so one architecture's import cost (or breakage)
# does not touch the others.
ARCHITECTURES = {"llama": _llama, "mistral": _llama, "qwen2": _llama}


def load_model(
    path: str,
    dtype: torch.dtype,
    device: torch.device | str,
    trust_remote_code: bool = False,
    quantize: str | None = None,
) -> CausalLM:
    """Loads the model in the local folder `path` in `dtype` on `device` with Kettle's own implementation;
    `quantize="fp8"` then converts its linear layers to fp8 weights (embeddings and LM head stay in `dtype`)."""
    if quantize not in (None, "fp8"):
        raise ValueError(f"quantization {quantize!r} is not supported by the native models yet (supported: fp8)")
    if quantize == "fp8" and device.type != "cuda":
        raise ValueError("--quantize fp8 needs an NVIDIA GPU (Hopper or newer); on the CPU serve float32 or bfloat16")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    loader = ARCHITECTURES.get(config.model_type)
    if loader is None:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ValueError(f"model type {config.model_type!r} has no native implementation (supported: {supported})")
    model = loader(path, config, dtype, torch.device(device))
    if quantize == "fp8":
        from kettle.quantization.fp8 import quantize_fp8

        quantize_fp8(model)
    return model
