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
# The families whose loaders read per-rank slices (kettle.layers.parallel); the others run on one shard only.
TENSOR_PARALLEL = {"llama", "mistral", "qwen2", "gpt_bigcode"}


def _native(module: str, cls: str):
    """A loader for `kettle.models.<module>.<cls>`, imported on first use like `_llama`."""

    def load(path: str, config, dtype: torch.dtype, device: torch.device) -> CausalLM:
        import importlib

        model_cls = getattr(importlib.import_module(f"kettle.models.{module}"), cls)
        return model_cls.from_pretrained(path, config, dtype, device)

    return load


# GPT-style families and Gemma 2, one file each; aliases are the model_types older configs carry.
ARCHITECTURES.update(
    {
        "gpt2": _native("gpt2", "GPT2ForCausalLM"),
        "gpt_bigcode": _native("gpt_bigcode", "GPTBigCodeForCausalLM"),
        "opt": _native("opt", "OPTForCausalLM"),
        "bloom": _native("bloom", "BloomForCausalLM"),
        "mpt": _native("mpt", "MptForCausalLM"),
        "falcon": _native("falcon", "FalconForCausalLM"),
        "RefinedWeb": _native("falcon", "FalconForCausalLM"),
        "RefinedWebModel": _native("falcon", "FalconForCausalLM"),
        "gemma2": _native("gemma2", "Gemma2ForCausalLM"),
    }
)

# RoPE families beyond Llama, one file each (pieces shared through kettle/models/decoder.py).
ARCHITECTURES.update(
    {
        "mixtral": _native("mixtral", "MixtralForCausalLM"),
        "qwen3": _native("qwen3", "Qwen3ForCausalLM"),
        "gemma": _native("gemma", "GemmaForCausalLM"),
        "phi": _native("phi", "PhiForCausalLM"),
        "phi3": _native("phi3", "Phi3ForCausalLM"),
        "gptj": _native("gptj", "GPTJForCausalLM"),
        "gpt_neox": _native("gpt_neox", "GPTNeoXForCausalLM"),
        "starcoder2": _native("starcoder2", "Starcoder2ForCausalLM"),
    }
)


def check_tensor_parallel(model_type: str, world_size: int | None = None) -> None:
    """Refuses a sharded run of a family that has no tensor-parallel implementation, naming it."""
    from kettle.shard import distributed

    world_size = distributed.current().world_size if world_size is None else world_size
    if world_size > 1 and model_type not in TENSOR_PARALLEL:
        supported = ", ".join(sorted(TENSOR_PARALLEL))
        raise ValueError(
            f"model type {model_type!r} does not support tensor parallelism (--num-shard {world_size}): "
            f"run it with --num-shard 1 (tensor-parallel families: {supported})"
        )


def check_tensor_parallel_folder(path: str, world_size: int) -> None:
    """`check_tensor_parallel` for a model folder, from its config.json (the launcher's check, before any shard)."""
    import json
    from pathlib import Path

    config = json.loads((Path(path) / "config.json").read_text())
    check_tensor_parallel(config.get("model_type", "unknown"), world_size)


def load_model(
    path: str,
    dtype: torch.dtype,
    device: torch.device | str,
    trust_remote_code: bool = False,
    quantize: str | None = None,
) -> CausalLM:
    """Loads the model in the local folder `path` in `dtype` on `device` with Kettle's own implementation (or
    through transformers when it has none: `transformers_fallback.py`); `quantize="fp8"` then converts its
    linear layers to fp8 weights (embeddings and LM head stay in `dtype`); int8/int4 (and GPTQ/AWQ checkpoints,
    found from their `quantization_config`) quantize the CPU model as it loads (kettle/quantization/loading.py)."""
    from transformers import AutoConfig

    from kettle.models.rope_override import apply_rope_override
    from kettle.models.transformers_fallback import check_loadable, load_transformers_model
    from kettle.quantization.loading import finish, quantizing, resolve_scheme

    check_loadable(path, trust_remote_code)  # clear errors for custom code / unknown types, before transformers'
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    apply_rope_override(config)  # --rope-scaling / --rope-factor, handed over by the launcher
    scheme = resolve_scheme(quantize, config, torch.device(device).type)  # clear errors for unsupported values
    quantize = quantize or (scheme and scheme.method)
    loader = ARCHITECTURES.get(config.model_type)
    check_tensor_parallel(config.model_type)
    if loader is None:
        # No native implementation: transformers runs it (padded batches; seq2seq for encoder-decoders).
        if quantize is not None:
            raise ValueError(f"--quantize {quantize} needs a native implementation; {config.model_type!r} has none")
        return load_transformers_model(path, config, dtype, torch.device(device), trust_remote_code)
    with quantizing(scheme):
        model = finish(loader(path, config, dtype, torch.device(device)), scheme)
    if quantize == "fp8":
        from kettle.quantization.fp8 import quantize_fp8

        quantize_fp8(model)
    return model
