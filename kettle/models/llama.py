"""The Llama family: Llama 2/3/3.1, Code Llama, TinyLlama, SmolLM, Mistral and Qwen2, over a paged KV cache.

These share one block (pre-norm RMSNorm, RoPE attention with grouped-query heads, SiLU-gated MLP); they
differ only in facts read from the config and the checkpoint: biases on q/k/v (Qwen2; detected from the
weights), sliding-window layers (Mistral, some Qwen2), the RoPE scaling, and tied embeddings.

A forward takes the flat tokens of every sequence in the step ([T]) and returns their final hidden states;
`compute_logits` then projects only the rows the caller needs (usually each sequence's last token).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kettle.kernels import ops
from kettle.kernels.decoder_step import DecoderStep
from kettle.layers.attention import AttentionMetadata, paged_attention
from kettle.layers.cuda_fused import fused_enabled, silu_mul, unit_stride
from kettle.layers.norm import RMSNorm
from kettle.layers.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    load_vocab_parallel,
    query_columns,
    shard_heads,
    vocab_parallel_embedding,
    vocab_parallel_head,
)
from kettle.layers.rotary import RotaryEmbedding
from kettle.models.spec import ModelSpec
from kettle.models.weights import Weights
from kettle.shard.kv_cache import KVCache


def rope_parameters(config) -> dict:
    """RoPE settings from a transformers config: v5's `rope_parameters`, or v4's `rope_theta` + `rope_scaling`."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding window: Mistral applies `sliding_window` everywhere, Qwen2 where `layer_types` say."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or config.model_type == "llama":
        return [None] * config.num_hidden_layers
    if layer_types is None:
        return [window] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def build_spec(config, dtype: torch.dtype, vocab_size: int) -> ModelSpec:
    """The architecture-independent facts of a Llama-family config."""
    windows = layer_windows(config)
    return ModelSpec(
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        hidden_size=config.hidden_size,
        vocab_size=vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        sliding_window=windows[0] if len(set(windows)) == 1 else None,
        dtype=dtype,
    )


class LlamaAttention(nn.Module):
    """Fused qkv projection, RoPE on q and k in one op, paged attention, output projection."""

    def __init__(self, weights: Weights, prefix: str, spec: ModelSpec, sliding_window: int | None) -> None:
        super().__init__()
        qkv = [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"]
        self.qkv = ColumnParallelLinear.load_qkv(weights, qkv, spec.head_dim)
        self.o_proj = RowParallelLinear.load(weights, f"{prefix}.o_proj", query_columns(weights, qkv, spec.head_dim))
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.scale = spec.head_dim**-0.5
        self.sliding_window = sliding_window

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        heads, qk_heads = self.num_heads, self.num_heads + self.num_kv_heads
        qkv = self.qkv(x).view(x.shape[0], qk_heads + self.num_kv_heads, self.head_dim)
        qk = RotaryEmbedding.apply(qkv[:, :qk_heads], cos, sin)
        out = paged_attention(
            qk[:, :heads], qk[:, heads:], qkv[:, qk_heads:], k_cache, v_cache, meta, self.scale, self.sliding_window
        )
        return self.o_proj(out.reshape(x.shape[0], heads * self.head_dim))


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, weights: Weights, prefix: str, hidden_act: str) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"activation {hidden_act!r} is not supported for the Llama family (only silu)")
        self.gate_up = ColumnParallelLinear.load(weights, [f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.down = RowParallelLinear.load(weights, f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if fused_enabled(gate_up) and unit_stride(gate_up):
            return self.down(silu_mul(gate_up))  # one kernel on CUDA instead of silu, then mul
        if ops.fits(gate_up):
            return self.down(ops.silu_mul(gate_up))  # and one C call on the CPU (float32)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)).

    The residual stream is carried separately from the block's output: each residual add is done by the
    norm that follows it (`RMSNorm.add_forward`), which on CUDA is one fused kernel for both. The layer gets
    the previous layer's MLP output with the residual it has not been added to yet (None for the first
    layer, whose input is the embedding) and returns the same pair.
    """

    def __init__(self, weights: Weights, prefix: str, config, spec: ModelSpec, window: int | None) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_norm = RMSNorm(weights.get(f"{prefix}.input_layernorm.weight"), eps)
        self.attn = LlamaAttention(weights, f"{prefix}.self_attn", spec, window)
        self.post_attention_norm = RMSNorm(weights.get(f"{prefix}.post_attention_layernorm.weight"), eps)
        self.mlp = LlamaMLP(weights, f"{prefix}.mlp", config.hidden_act)

    def forward(
        self, h, residual, cos, sin, k_cache, v_cache, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_norm(h), h
        else:
            x, residual = self.input_norm.add_forward(h, residual)
        attn = self.attn(x, cos, sin, k_cache, v_cache, meta)
        x, residual = self.post_attention_norm.add_forward(attn, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM built directly from a checkpoint's tensors (no random init, no copy)."""

    def __init__(self, config, weights: Weights) -> None:
        super().__init__()
        # Under tensor parallelism each rank holds a block of the vocabulary (kettle.layers.parallel).
        self.tp = weights.tp
        names = ("model.embed_tokens.weight", "lm_head.weight")
        embed, head, vocab_size = load_vocab_parallel(weights, *names, config.tie_word_embeddings)
        self.lm_head = vocab_parallel_head(head, vocab_size, self.tp)
        # Tied: the embedding reads the head's storage (a view when the head is kept transposed), never a copy;
        # a oneDNN-packed head has no row view, so there the embedding keeps the checkpoint tensor.
        shared = head is embed and self.lm_head.layout != "onednn"
        self.register_buffer("embed_tokens", self.lm_head.dense_weight if shared else embed, persistent=False)
        self.spec = shard_heads(build_spec(config, weights.dtype, self.lm_head.out_features), self.tp)
        windows = layer_windows(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(weights, f"model.layers.{i}", config, self.spec, windows[i])
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(weights.get("model.norm.weight"), config.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            self.spec.head_dim, rope_parameters(config), config.max_position_embeddings, weights.dtype, weights.device
        )
        if self.rotary.rotary_dim != self.spec.head_dim:  # the attention rotates whole heads (RotaryEmbedding.apply)
            raise ValueError("partial rotary embeddings are not supported for the Llama family")

    @classmethod
    def from_pretrained(cls, path: str, config, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
        """Loads the checkpoint in `path` (safetensors) for an already parsed transformers `config`."""
        with Weights(path, dtype, device) as weights:
            return cls(config, weights).eval()

    @functools.cached_property
    def cpu_decoder_step(self) -> DecoderStep | None:
        """The fused CPU decode step for this model, built on first use (after quantization), or None."""
        return DecoderStep.build(self)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions [T] → final hidden states [T, hidden]; writes the step's K/V into `kv_cache`."""
        h, residual = vocab_parallel_embedding(input_ids, self.embed_tokens, self.tp), None
        cos, sin = self.rotary(positions, meta)
        step = self.cpu_decoder_step
        if step is not None and step.fits(kv_cache, meta):
            return step(h, cos, sin, kv_cache, meta)  # every layer in one C call (kettle/kernels/decoder_step.py)
        for layer, k_cache, v_cache in zip(self.layers, kv_cache.k, kv_cache.v, strict=True):
            h, residual = layer(h, residual, cos, sin, k_cache, v_cache, meta)
        return self.norm.add_forward(h, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] → logits [N, vocab] in float32 (sampling and logprobs want full precision)."""
        return self.lm_head(hidden).float()
