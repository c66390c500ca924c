"""BLOOM over a paged KV cache: ALiBi instead of positions, and a LayerNorm right after the embedding.

The fused query_key_value is stored per head ([heads, 3, head_dim] rows) and regrouped at load into
[q | k | v]. ALiBi slopes follow BLOOM's recipe (non-power-of-two head counts included) and are passed to
`paged_attention`, which adds slope · (key_pos - query_pos) to the scores.
"""

from __future__ import annotations

import torch
from torch import nn

from kettle.layers.alibi import bloom_alibi_slopes
from kettle.layers.attention import AttentionMetadata
from kettle.layers.linear import Linear
from kettle.layers.parallel import rank_heads
from kettle.models.blocks import DenseMLP, checkpoint_prefix, load_layer_norm, load_per_head_attention
from kettle.models.decoder import Attention, SequentialBlock
from kettle.models.decoder_lm import CausalLM, decoder_spec
from kettle.models.spec import ModelSpec, shard_heads
from kettle.tensors.weights import Weights

# ALiBi has no trained length limit; BLOOM was trained on 2048-token sequences.
DEFAULT_MAX_POSITIONS = 2048


class BloomBlock(SequentialBlock):
    """x + attn(ln(x)), then x + mlp(ln(x)); with `apply_residual_connection_post_layernorm` the residual
    branch carries the normalised input instead of the input. Attention reads the regrouped query_key_value
    and adds ALiBi instead of positions."""

    def __init__(self, weights: Weights, prefix: str, config, spec: ModelSpec, slopes: torch.Tensor) -> None:
        eps, attn, mlp = config.layer_norm_epsilon, f"{prefix}.self_attention", f"{prefix}.mlp"
        if weights.gguf is not None and not weights.tp.sharded:
            # llama.cpp's converter already regrouped it into [q | k | v]: loading it as stored keeps a quantized
            # file's blocks.
            qkv, dense = Linear.load(weights, [f"{attn}.query_key_value"]), Linear.load(weights, [f"{attn}.dense"])
        else:
            qkv, dense = load_per_head_attention(
                weights, f"{attn}.query_key_value", f"{attn}.dense", config.n_head, spec.head_dim
            )
        super().__init__(
            load_layer_norm(weights, f"{prefix}.input_layernorm", eps),
            Attention(qkv, dense, spec, None, alibi_slopes=slopes),
            load_layer_norm(weights, f"{prefix}.post_attention_layernorm", eps),
            # BLOOM's own GELU is the tanh approximation.
            DenseMLP.load(weights, f"{mlp}.dense_h_to_4h", f"{mlp}.dense_4h_to_h", "gelu_new"),
        )
        self.residual_from_norm = getattr(config, "apply_residual_connection_post_layernorm", False)

    def forward(self, h, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        x = self.input_norm(h)
        h = (x if self.residual_from_norm else h) + self.attn(x, cos, sin, k_cache, v_cache, meta)
        x = self.post_attention_norm(h)
        return (x if self.residual_from_norm else h) + self.mlp(x)


class BloomForCausalLM(CausalLM):
    """BLOOM built directly from a checkpoint's tensors."""

    def __init__(self, config, weights: Weights) -> None:
        super().__init__()
        prefix = checkpoint_prefix(weights, "word_embeddings.weight", ("transformer.", ""))
        tied = getattr(config, "tie_word_embeddings", True)
        vocab = self.load_embeddings(weights, f"{prefix}word_embeddings.weight", "lm_head.weight", tied)
        eps = config.layer_norm_epsilon
        self.embed_norm = load_layer_norm(weights, f"{prefix}word_embeddings_layernorm", eps)
        max_positions = getattr(config, "seq_length", None) or DEFAULT_MAX_POSITIONS
        spec = decoder_spec(
            config, weights.dtype, vocab, num_kv_heads=config.n_head, max_position_embeddings=max_positions
        )
        self.spec = shard_heads(spec, weights.tp)
        # Each rank adds the slopes of its own heads (they are computed for the whole model's head count).
        slopes = rank_heads(bloom_alibi_slopes(config.n_head), config.n_head, config.n_head, weights.tp)
        slopes = slopes.to(weights.device)
        self.layers = nn.ModuleList(
            BloomBlock(weights, f"{prefix}h.{i}", config, self.spec, slopes) for i in range(config.n_layer)
        )
        self.norm = load_layer_norm(weights, f"{prefix}ln_f", eps)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token embeddings through BLOOM's embedding LayerNorm."""
        return self.embed_norm(super().embed(input_ids, positions))
