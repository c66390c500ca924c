"""GPT-BigCode (SantaCoder, StarCoder, StarCoderBase) over a paged KV cache.

GPT-2's block with nn.Linear projections (weights [out, in], no transpose) and, usually, multi-query
attention: one K/V head shared by every query head, so c_attn yields [q (hidden) | k (head_dim) | v
(head_dim)] and the KV cache holds one head per layer. Without `multi_query` c_attn is laid out per head
([heads, 3, head_dim]) and is regrouped at load.
"""

from __future__ import annotations

import torch
from torch import nn

from kettle.layers.activation import activation
from kettle.layers.linear import Linear
from kettle.layers.parallel import ColumnParallelLinear, RowParallelLinear, attention_columns
from kettle.models.blocks import DenseMLP, checkpoint_prefix, load_layer_norm, load_per_head_qkv
from kettle.models.decoder import Attention, SequentialBlock
from kettle.models.decoder_lm import CausalLM, decoder_spec
from kettle.models.spec import ModelSpec, shard_heads
from kettle.tensors.weights import Weights


def load_attention(weights: Weights, prefix: str, config, spec: ModelSpec) -> Attention:
    """c_attn → q [T, H, D], k/v [T, Hkv, D], paged attention (no RoPE: learned positions), c_proj."""
    # Under tensor parallelism each rank takes its query heads; multi-query's one KV head is replicated.
    heads, kv_heads, head_dim = config.n_head, 1 if config.multi_query else config.n_head, spec.head_dim
    c_attn: Linear
    if config.multi_query:
        c_attn = ColumnParallelLinear.load_fused_qkv(weights, f"{prefix}.c_attn", heads, kv_heads, head_dim)
    else:
        c_attn = load_per_head_qkv(weights, f"{prefix}.c_attn", heads)
    columns = attention_columns(weights.tp, heads, kv_heads, head_dim)
    c_proj = RowParallelLinear.load(weights, f"{prefix}.c_proj", columns)
    return Attention(c_attn, c_proj, spec, None, scale=head_dim**-0.5 if config.scale_attn_weights else 1.0)


def bigcode_block(weights: Weights, prefix: str, config, spec: ModelSpec) -> SequentialBlock:
    """x + attn(ln_1(x)), then x + mlp(ln_2(x))."""
    eps = config.layer_norm_epsilon
    fc = ColumnParallelLinear.load(weights, [f"{prefix}.mlp.c_fc"])
    proj = RowParallelLinear.load(weights, f"{prefix}.mlp.c_proj")
    return SequentialBlock(
        load_layer_norm(weights, f"{prefix}.ln_1", eps),
        load_attention(weights, f"{prefix}.attn", config, spec),
        load_layer_norm(weights, f"{prefix}.ln_2", eps),
        DenseMLP(fc, proj, activation(config.activation_function)),
    )


class GPTBigCodeForCausalLM(CausalLM):
    """GPT-BigCode built directly from a checkpoint's tensors."""

    def __init__(self, config, weights: Weights) -> None:
        super().__init__()
        if getattr(config, "add_cross_attention", False):
            raise ValueError("GPT-BigCode with cross-attention is not a causal LM Kettle serves")
        prefix = checkpoint_prefix(weights, "wte.weight", ("transformer.", ""))
        vocab = self.load_embeddings(weights, f"{prefix}wte.weight", "lm_head.weight", config.tie_word_embeddings)
        self.wpe = nn.Parameter(weights.get(f"{prefix}wpe.weight"), requires_grad=False)
        # One KV head with multi-query attention (the KV cache is sized from it), else one per query head.
        kv_heads = 1 if config.multi_query else config.n_head
        self.spec = shard_heads(decoder_spec(config, weights.dtype, vocab, num_kv_heads=kv_heads), weights.tp)
        self.layers = nn.ModuleList(
            bigcode_block(weights, f"{prefix}h.{i}", config, self.spec) for i in range(config.n_layer)
        )
        self.norm = load_layer_norm(weights, f"{prefix}ln_f", config.layer_norm_epsilon)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token embeddings plus learned absolute positions."""
        return super().embed(input_ids, positions) + self.wpe[positions]
