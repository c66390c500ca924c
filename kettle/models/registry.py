"""From a checkpoint folder to a loaded model: reads config.json and picks the implementation by model_type."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Protocol

import torch

from kettle.catalog import NATIVE, Family, check_loadable, check_tensor_parallel
from kettle.layers.attention import AttentionMetadata
from kettle.models.spec import ModelSpec
from kettle.tensors import distributed
from kettle.tensors.kv_cache import KVCache


class CausalLM(Protocol):
    """What the shard needs from any model: its spec, a paged forward, and logits for chosen rows."""

    spec: ModelSpec

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def native_loader(family: Family) -> Callable[..., CausalLM]:
    """`kettle.models.<module>.<cls>.from_pretrained`, the module imported on first use, so one architecture's
    import cost (or breakage) does not touch the others."""

    def load(path: str, config, dtype: torch.dtype, device: torch.device, quantize=None) -> CausalLM:
        model_cls = getattr(importlib.import_module(f"kettle.models.{family.module}"), family.cls)
        return model_cls.from_pretrained(path, config, dtype, device, quantize)

    return load


# model_type → loader, from the catalog the launcher reads too.
ARCHITECTURES = {model_type: native_loader(family) for model_type, family in NATIVE.items()}


def load_model(
    path: str,
    dtype: torch.dtype,
    device: torch.device | str,
    trust_remote_code: bool = False,
    quantize: str | None = None,
    dequantize: bool = False,
) -> CausalLM:
    """Loads the model in the local folder `path` in `dtype` on `device` with Kettle's own implementation (or
    through transformers when it has none: `transformers_fallback.py`); `quantize="fp8"` then converts its
    linear layers to fp8 weights (embeddings and LM head stay in `dtype`); int8/int4 (and GPTQ/AWQ checkpoints,
    found from their `quantization_config`) quantize the CPU model as it loads (kettle/quantization/loading.py).
    A GGUF folder with no `quantize` serves its own quantization on the CPU unless `dequantize` (a float --dtype)
    asks for dense weights (kettle/quantization/gguf_scheme.py)."""
    from kettle.models.hf_config import load_config
    from kettle.models.rope_override import apply_rope_override
    from kettle.quantization.loading import default_gguf_scheme, finish, resolve_scheme

    check_loadable(path, trust_remote_code)  # clear errors for custom code / unknown types, before transformers'
    config = load_config(path, trust_remote_code)
    apply_rope_override(config)  # --rope-scaling / --rope-factor, handed over by the launcher
    scheme = resolve_scheme(quantize, config, torch.device(device).type)  # clear errors for unsupported values
    serve_as_stored = scheme is None and quantize is None and not dequantize
    if serve_as_stored or quantize in ("int4", "int8"):
        own = default_gguf_scheme(path, torch.device(device).type)
        # A GGUF file already on the scheme asked for keeps its own blocks: requantizing them could only lose.
        if own is not None and (quantize is None or own.method == quantize):
            scheme = own
    quantize = quantize or (scheme and scheme.method)
    loader = ARCHITECTURES.get(config.model_type)
    check_tensor_parallel(config.model_type, distributed.current().world_size)
    if loader is None:
        # No native implementation: transformers runs it (padded batches; seq2seq for encoder-decoders).
        if quantize is not None:
            raise ValueError(f"--quantize {quantize} needs a native implementation; {config.model_type!r} has none")
        return load_transformers_model(path, config, dtype, torch.device(device), trust_remote_code)
    model = finish(loader(path, config, dtype, torch.device(device), scheme), scheme)
    if quantize == "fp8":
        from kettle.quantization.fp8 import quantize_fp8

        quantize_fp8(model)
    return model


def load_transformers_model(
    path: str, config, dtype: torch.dtype, device: torch.device, trust_remote_code: bool = False
) -> CausalLM:
    """The fallback for `config`: the seq2seq path for encoder-decoder models, the causal one otherwise (with its
    vision tower for an image-text-to-text model)."""
    if getattr(config, "is_encoder_decoder", False):
        from kettle.models.seq2seq import TransformersSeq2SeqLM

        return TransformersSeq2SeqLM.from_pretrained(path, dtype, device, trust_remote_code)
    from kettle.models import transformers_vision

    if transformers_vision.serves(config):
        return transformers_vision.TransformersVisionLM.from_pretrained(path, dtype, device, trust_remote_code)
    from kettle.models.transformers_fallback import TransformersCausalLM

    return TransformersCausalLM.from_pretrained(path, dtype, device, trust_remote_code)
