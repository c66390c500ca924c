"""A Llama-family decode step in one call into Kettle's CPU kernels (kettle/kernels/decoder_step.c).

`DecoderStep.build(model)` describes a loaded `LlamaForCausalLM` to the C step once (pointers to its norms and
quantized projections); `step(embedded, cos, sin, kv_cache, meta)` then runs every layer of a decode-only
step and returns the final norm's output, as the model's own forward would, but without ~10 Python-level ops
and OpenMP fork/joins per layer (the measurement is in decoder_step.c).

It applies only where the op-at-a-time path would run the same kernels: a CPU float32 model whose every
projection is a `Q4Linear` or a kernel-backed `Int8Linear`, one shard, quantized activations on, a float32
cache and a decode batch the packed kernels take (`dense_rows`). Anything else returns None from `build`
(or False from `fits`) and the model's forward runs layer by layer. `KETTLE_CPU_DECODER_STEP=0` turns it off.
"""

from __future__ import annotations

import ctypes
import os

import torch
from torch import nn

from kettle.kernels import ops
from kettle.kernels.build import library
from kettle.layers.attention import AttentionMetadata
from kettle.quantization.int8 import Int8Linear
from kettle.quantization.q4 import Q4Linear
from kettle.shard.kv_cache import KVCache

ENV_SWITCH = "KETTLE_CPU_DECODER_STEP"
LINEAR_Q4, LINEAR_Q8 = 1, 2
_int, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Linear(ctypes.Structure):
    _fields_ = [("kind", _int), ("group", _int), ("n", _int), ("k", _int)]
    _fields_ += [("weight", _ptr), ("scales", _ptr), ("mins", _ptr), ("bias", _ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr)]
    _fields_ += [(name, _Linear) for name in ("qkv", "o", "gate_up", "down")] + [("window", _int)]


class _Decoder(ctypes.Structure):
    _fields_ = [(name, _int) for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim", "inner")]
    _fields_ += [("block_size", _int), ("float_rows_q4", _int), ("float_rows_q8", _int)]
    _fields_ += [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
    _fields_ += [("layers", ctypes.POINTER(_Layer)), ("final_norm", _ptr)]


def enabled() -> bool:
    """False when `KETTLE_CPU_DECODER_STEP=0`."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


def _ptr_of(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _linear(module: nn.Module) -> _Linear | None:
    """The C description of a projection (unwrapping a row-parallel one), None if the step cannot run it."""
    module = getattr(module, "linear", module)
    bias = _ptr_of(module.bias)
    if isinstance(module, Q4Linear):
        weights = (module.packed.data_ptr(), module.scales.data_ptr(), module.mins.data_ptr())
        return _Linear(LINEAR_Q4, module.group_size, module.out_features, module.in_features, *weights, bias)
    if isinstance(module, Int8Linear) and module.cpu_kernel and module.in_features % 32 == 0:
        n, k = module.out_features, module.in_features
        return _Linear(LINEAR_Q8, k, n, k, module.q.data_ptr(), module.scale.data_ptr(), None, bias)
    return None


class DecoderStep:
    """A model's decode step in one C call; holds the C description of its layers (and so needs the model
    to stay where it was loaded: its tensors are read through raw pointers)."""

    def __init__(self, model: nn.Module, layers: list[_Layer]) -> None:
        spec, first = model.spec, model.layers[0]
        self._layers = (_Layer * len(layers))(*layers)
        shape = (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim)
        inner = first.mlp.gate_up.out_features // 2
        rows = (ops.Q4_FLOAT_ROWS, ops.Q8_FLOAT_ROWS)
        eps_scale = (first.input_norm.eps, first.attn.scale)  # RMSNorm epsilon, attention scale
        # block_size (0 here) is set from each step's metadata.
        self.decoder = _Decoder(*shape, inner, 0, *rows, *eps_scale, self._layers, model.norm.weight.data_ptr())
        self.max_rows = min(
            getattr(m, "dense_rows", 1 << 62) for m in model.modules() if isinstance(m, Q4Linear | Int8Linear)
        )
        self._caches: tuple[KVCache, ctypes.Array, ctypes.Array] | None = None

    @classmethod
    def build(cls, model: nn.Module) -> DecoderStep | None:
        """The step for `model`, or None when it does not apply (module docstring)."""
        if not (enabled() and ops.available() and ops.QUANTIZED_ACTIVATIONS) or model.tp.sharded:
            return None
        if model.spec.dtype != torch.float32 or model.norm.weight.device.type != "cpu":
            return None
        layers = [_layer(layer) for layer in model.layers]
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
        rows, plan = embedded.shape[0], meta.decode
        self.decoder.block_size = meta.block_size
        k_caches, v_caches = self._cache_pointers(kv_cache)
        embedded, cos, sin = embedded.contiguous(), cos.contiguous(), sin.contiguous()
        out = torch.empty_like(embedded)
        status = library().kettle_decoder_step(
            ctypes.byref(self.decoder), k_caches, v_caches, embedded.data_ptr(), rows, cos.data_ptr(), sin.data_ptr(),
            meta.slots.data_ptr(), plan.block_ids.data_ptr(), plan.num_blocks, meta.positions.data_ptr(),
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if status:
            raise MemoryError("CPU decoder step: out of memory for the step's activations")
        return out

    def _cache_pointers(self, kv_cache: KVCache) -> tuple[ctypes.Array, ctypes.Array]:
        """The per-layer cache pointers, rebuilt only when the cache object changes (it is kept alive here)."""
        if self._caches is None or self._caches[0] is not kv_cache:
            pointers = ctypes.c_void_p * kv_cache.num_layers
            k = pointers(*(t.data_ptr() for t in kv_cache.k))
            v = pointers(*(t.data_ptr() for t in kv_cache.v))
            self._caches = (kv_cache, k, v)
        return self._caches[1], self._caches[2]


def _layer(layer: nn.Module) -> _Layer | None:
    """The C description of one `LlamaDecoderLayer`, None if a projection is not one the step runs."""
    linears = [_linear(m) for m in (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down)]
    if any(linear is None for linear in linears):
        return None
    norms = (layer.input_norm.weight.data_ptr(), layer.post_attention_norm.weight.data_ptr())
    return _Layer(*norms, *linears, layer.attn.sliding_window or 0)
