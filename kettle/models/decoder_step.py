"""A decoder's whole decode step in one call into Kettle's CPU kernels (kettle/kernels/decoder_step.c).

`DecoderStep.build(model)` describes a loaded `DecoderLM` to the C step once (pointers to its norms and
quantized projections); `step(embedded, cos, sin, kv_cache, meta)` then runs every layer of a decode-only
step and returns the final norm's output, as the model's own forward would, but without ~10 Python-level ops
and OpenMP fork/joins per layer (the measurement is in decoder_step.c).

It applies only to blocks the C step computes as the layer-by-layer forward does: pre-norm layers with
RMSNorms, attention with full RoPE in halves layout (per-head q/k RMSNorms allowed; no soft-cap, ALiBi or
clipping) and a SiLU- or tanh-GELU-gated MLP (Llama, Mistral, Qwen2, Qwen3, Gemma, Phi-3 without partial
rotary); a CPU float32 model whose every projection is a `Q4Linear`, a kernel-backed `Int8Linear` or a
float32 `Linear` stored dense (`KETTLE_CPU_LINEAR=dense`: the default oneDNN-packed layout has no rows to
read), one shard, quantized activations on, a float32 cache and a decode batch the packed kernels take
(`dense_rows`). Anything else returns None from `build` (or False from `fits`) and the model's forward runs
layer by layer. `KETTLE_CPU_DECODER_STEP=0` turns it off.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from kettle import settings
from kettle.kernels import ops
from kettle.kernels.decoder_step import (
    ACT_GELU_TANH,
    ACT_SILU,
    LINEAR_F32,
    LINEAR_Q4,
    LINEAR_Q8,
    Decoder,
    Layer,
    Linear,
    run,
)
from kettle.layers import linear as dense
from kettle.layers.activation import activation
from kettle.layers.attention import AttentionMetadata
from kettle.layers.norm import RMSNorm
from kettle.layers.rotary import RotaryEmbedding
from kettle.models.blocks import GatedMLP
from kettle.models.decoder import Attention, PreNormLayer
from kettle.quantization.int8 import Int8Linear
from kettle.quantization.q4 import Q4Linear
from kettle.tensors.kv_cache import KVCache


def enabled() -> bool:
    """False when `KETTLE_CPU_DECODER_STEP=0`."""
    return settings.current().cpu_decoder_step


def _ptr_of(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _linear(module: nn.Module) -> Linear | None:
    """The C description of a projection (unwrapping a row-parallel one), None if the step cannot run it."""
    while hasattr(module, "linear"):  # row-parallel and LoRA wrappers hold the projection itself
        module = module.linear
    bias = _ptr_of(getattr(module, "bias", None))
    if isinstance(module, Q4Linear):
        weights = (module.packed.data_ptr(), module.scales.data_ptr(), module.mins.data_ptr())
        return Linear(LINEAR_Q4, module.group_size, module.out_features, module.in_features, *weights, bias)
    if isinstance(module, Int8Linear) and module.cpu_kernel and module.in_features % 32 == 0:
        n, k = module.out_features, module.in_features
        return Linear(LINEAR_Q8, k, n, k, module.q.data_ptr(), module.scale.data_ptr(), None, bias)
    if isinstance(module, dense.Linear) and module.layout == "dense" and _float32_rows(module.weight):
        n, k = module.weight.shape
        return Linear(LINEAR_F32, k, n, k, module.weight.data_ptr(), None, None, bias)
    return None


def _float32_rows(weight: torch.Tensor) -> bool:
    """A float32 [out, in] CPU weight the C tiles read in place (rows of a multiple of 8 floats)."""
    return (
        weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.is_contiguous()
        and weight.shape[1] % 8 == 0
    )


# The gate activations the C step has, by the function a `GatedMLP` applies.
GATE_ACTIVATIONS = {activation("silu"): ACT_SILU, activation("gelu_pytorch_tanh"): ACT_GELU_TANH}


def _rms_norms(norms: tuple, eps: float) -> bool:
    return all(isinstance(norm, RMSNorm) and norm.eps == eps for norm in norms)


def _step_attention(attn: nn.Module, eps: float) -> bool:
    """Attention the C step computes: full RoPE in halves layout, optional per-head RMSNorms on q and k, and
    nothing else around the scores."""
    extras = (attn.alibi_slopes, attn.softcap, attn.clip)
    qk_norms = attn.q_norm is None or _rms_norms((attn.q_norm, attn.k_norm), eps)
    return attn.rotate is RotaryEmbedding.apply and qk_norms and all(x is None for x in extras)


def _layer(layer: nn.Module, eps: float, scale: float, act: int) -> Layer | None:
    """The C description of one pre-norm layer, None if any of its blocks is one the step does not run."""
    norms = (layer.input_norm, layer.post_attention_norm)
    if not (_rms_norms(norms, eps) and _step_attention(layer.attn, eps) and layer.attn.scale == scale):
        return None
    if GATE_ACTIVATIONS.get(getattr(layer.mlp, "act", None)) != act or not isinstance(layer.mlp, GatedMLP):
        return None
    linears = [_linear(m) for m in (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down)]
    if any(linear is None for linear in linears):
        return None
    qk_norms = (
        _ptr_of(getattr(layer.attn.q_norm, "weight", None)),
        _ptr_of(getattr(layer.attn.k_norm, "weight", None)),
    )
    return Layer(*(n.weight.data_ptr() for n in norms), *linears, layer.attn.sliding_window or 0, *qk_norms)


class DecoderStep:
    """A model's decode step in one C call; holds the C description of its layers (and so needs the model
    to stay where it was loaded: its tensors are read through raw pointers)."""

    def __init__(self, model: nn.Module, layers: list[Layer]) -> None:
        spec, first = model.spec, model.layers[0]
        self._layers = (Layer * len(layers))(*layers)
        shape = (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim)
        inner = first.mlp.gate_up.out_features // 2
        rows = (ops.Q4_FLOAT_ROWS, ops.Q8_FLOAT_ROWS)
        eps_scale = (first.input_norm.eps, first.attn.scale)  # RMSNorm epsilon, attention scale
        # block_size (0 here) is set from each step's metadata.
        final_norm, act = model.norm.weight.data_ptr(), GATE_ACTIVATIONS[first.mlp.act]
        self.decoder = Decoder(*shape, inner, 0, *rows, *eps_scale, self._layers, final_norm, act)
        quantized = (m for m in model.modules() if isinstance(m, Q4Linear | Int8Linear))
        self.max_rows = min((getattr(m, "dense_rows", 1 << 62) for m in quantized), default=1 << 62)
        self._caches: tuple[KVCache, ctypes.Array, ctypes.Array] | None = None

    @classmethod
    def build(cls, model: nn.Module) -> DecoderStep | None:
        """The step for `model`, or None when it does not apply (module docstring)."""
        if not (enabled() and ops.available() and ops.QUANTIZED_ACTIVATIONS) or model.tp.sharded:
            return None
        norm = getattr(model, "norm", None)
        if not isinstance(norm, RMSNorm) or model.spec.dtype != torch.float32 or norm.weight.device.type != "cpu":
            return None
        first = model.layers[0]
        if not all(isinstance(layer, PreNormLayer) and isinstance(layer.attn, Attention) for layer in model.layers):
            return None
        act = GATE_ACTIVATIONS.get(getattr(first.mlp, "act", None))
        layers = [_layer(layer, norm.eps, first.attn.scale, act) for layer in model.layers]
        return None if any(layer is None for layer in layers) else cls(model, layers)

    def fits(self, kv_cache: KVCache, meta: AttentionMetadata) -> bool:
        """Whether this step can run `meta` over `kv_cache`: decodes only, a float32 CPU cache, few enough rows."""
        return (
            meta.decode_only
            and meta.num_tokens <= self.max_rows
            and kv_cache.dtype == torch.float32
            and kv_cache.device.type == "cpu"
        )

    def __call__(
        self, embedded: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """embedded [S, hidden] float32 → the final norm's output [S, hidden]; writes the step's K/V."""
        self.decoder.block_size = meta.block_size
        k_caches, v_caches = self._cache_pointers(kv_cache)
        plan = meta.decode
        return run(
            self.decoder, k_caches, v_caches, embedded, cos, sin, meta.slots, plan.block_ids, plan.num_blocks,
            meta.positions,
        )  # fmt: skip

    def _cache_pointers(self, kv_cache: KVCache) -> tuple[ctypes.Array, ctypes.Array]:
        """The per-layer cache pointers, rebuilt only when the cache object changes (it is kept alive here)."""
        if self._caches is None or self._caches[0] is not kv_cache:
            pointers = ctypes.c_void_p * kv_cache.num_layers
            k = pointers(*(t.data_ptr() for t in kv_cache.k))
            v = pointers(*(t.data_ptr() for t in kv_cache.v))
            self._caches = (kv_cache, k, v)
        return self._caches[1], self._caches[2]
