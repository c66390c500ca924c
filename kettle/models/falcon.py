"""Falcon (and its first names, RefinedWeb / RefinedWebModel) over a paged KV cache.

Three layouts, all read from the config:
- 7B (`multi_query`, `parallel_attn`): one K/V head, attention and MLP in parallel off one input LayerNorm;
  query_key_value rows are [q heads | k | v].
- 40B/180B (`new_decoder_architecture`): grouped K/V heads, separate ln_attn and ln_mlp (or one norm when
  `num_ln_in_parallel_attn` is 1); query_key_value rows are grouped per KV head ([kv, G q heads + k + v]).
- RW-1B style (neither): one K/V head per query head, rows interleaved per head, sequential blocks.
RoPE on the full head, or ALiBi when `alibi` is set (BLOOM's slopes, rounded to bfloat16 like the reference).
Under tensor parallelism each rank reads the KV groups of its heads (a replicated one when there are fewer
KV heads than ranks) and adds its heads' slopes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kettle.layers.alibi import bloom_alibi_slopes
from kettle.layers.attention import AttentionMetadata
from kettle.layers.linear import Linear
from kettle.layers.parallel import RowParallelLinear, attention_columns, rank_heads
from kettle.models.blocks import DenseMLP, checkpoint_prefix, load_grouped_qkv, load_layer_norm
from kettle.models.decoder import Attention, BlockPlan, SequentialBlock
from kettle.models.decoder_lm import CausalLM, decoder_spec, rotary_embedding
from kettle.models.hf_config import rope_parameters
from kettle.models.spec import ModelSpec, shard_heads
from kettle.tensors.weights import Weights


@dataclass(frozen=True)
class FalconLayout:
    """Which Falcon layout a config describes (transformers' FalconConfig or the remote-code RWConfig)."""

    num_heads: int
    num_kv_heads: int
    new_decoder: bool  # 40B: qkv grouped per KV head
    parallel_attn: bool
    two_norms: bool  # ln_attn + ln_mlp instead of one input_layernorm
    alibi: bool

    @classmethod
    def from_config(cls, config) -> FalconLayout:
        heads = getattr(config, "num_attention_heads", None) or config.n_head
        new_decoder = getattr(config, "new_decoder_architecture", None)
        if new_decoder is None:  # remote-code configs: "RefinedWeb" is the 40B layout, "RefinedWebModel" the 7B
            new_decoder = config.model_type == "RefinedWeb"
        if new_decoder:
            kv_heads = getattr(config, "num_kv_heads", None) or getattr(config, "n_head_kv", None) or heads
        else:
            kv_heads = 1 if getattr(config, "multi_query", True) else heads
        parallel = bool(getattr(config, "parallel_attn", True))
        if new_decoder and not parallel:
            raise ValueError("Falcon with new_decoder_architecture and parallel_attn=False is not supported")
        norms = getattr(config, "num_ln_in_parallel_attn", None) or 2
        alibi = bool(getattr(config, "alibi", False))
        return cls(heads, kv_heads, bool(new_decoder), parallel, bool(new_decoder) and norms == 2, alibi)


def load_qkv(weights: Weights, prefix: str, layout: FalconLayout, head_dim: int) -> Linear:
    """query_key_value as one Linear producing [q heads | k heads | v heads] whatever the stored layout (this
    rank's heads under tensor parallelism). Every layout is rows grouped per KV head: 40B's [kv, G + 2], the
    7B's one group of all heads, RW-1B's groups of one head (the per-head interleave)."""
    return load_grouped_qkv(weights, prefix, layout.num_heads, layout.num_kv_heads, head_dim)


class FalconDecoderLayer(SequentialBlock):
    """Parallel: x + attn(ln_a(x)) + mlp(ln_m(x)) (ln_a = ln_m with one norm). Sequential: x + attn(ln(x)),
    then x + mlp(post_ln(x)). Attention: query_key_value → q, k, v; RoPE (or ALiBi in the attention); dense."""

    def __init__(self, weights: Weights, prefix: str, config, layout: FalconLayout, spec: ModelSpec, slopes, rotate):
        eps, attn, mlp = config.layer_norm_epsilon, f"{prefix}.self_attention", f"{prefix}.mlp"
        norm_names = ("ln_attn", "ln_mlp") if layout.two_norms else ("input_layernorm", None)
        if not layout.parallel_attn:
            norm_names = ("input_layernorm", "post_attention_layernorm")
        qkv = load_qkv(weights, f"{attn}.query_key_value", layout, spec.head_dim)
        columns = attention_columns(weights.tp, layout.num_heads, layout.num_kv_heads, spec.head_dim)
        dense = RowParallelLinear.load(weights, f"{attn}.dense", columns)
        super().__init__(
            load_layer_norm(weights, f"{prefix}.{norm_names[0]}", eps),
            Attention(qkv, dense, spec, rotate, alibi_slopes=slopes),
            None if norm_names[1] is None else load_layer_norm(weights, f"{prefix}.{norm_names[1]}", eps),
            DenseMLP.load(
                weights, f"{mlp}.dense_h_to_4h", f"{mlp}.dense_4h_to_h", getattr(config, "activation", None) or "gelu"
            ),
        )
        self.parallel = layout.parallel_attn

    def forward(self, h, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if not self.parallel:
            return super().forward(h, cos, sin, k_cache, v_cache, meta)
        x = self.input_norm(h)
        attn = self.attn(x, cos, sin, k_cache, v_cache, meta)
        mlp_in = x if self.post_attention_norm is None else self.post_attention_norm(h)
        return h + (self.mlp(mlp_in) + attn)

    def plan(self) -> BlockPlan:
        """The block in the fused step's terms (parallel: the MLP's own norm, or the attention's input)."""
        return BlockPlan(self.input_norm, self.attn, self.mlp, self.post_attention_norm, parallel=self.parallel)


class FalconForCausalLM(CausalLM):
    """Falcon built directly from a checkpoint's tensors."""

    def __init__(self, config, weights: Weights) -> None:
        super().__init__()
        layout = FalconLayout.from_config(config)
        prefix = checkpoint_prefix(weights, "word_embeddings.weight", ("transformer.", ""))
        tied = getattr(config, "tie_word_embeddings", True)
        vocab = self.load_embeddings(weights, f"{prefix}word_embeddings.weight", "lm_head.weight", tied)
        # The KV cache holds `num_kv_heads` per layer: 1 for the 7B's multi-query attention.
        spec = decoder_spec(
            config, weights.dtype, vocab, num_heads=layout.num_heads, num_kv_heads=layout.num_kv_heads,
            num_layers=getattr(config, "num_hidden_layers", None) or config.n_layer,
            head_dim=config.hidden_size // layout.num_heads,
            max_position_embeddings=getattr(config, "max_position_embeddings", None) or 2048,
        )  # fmt: skip
        self.spec = shard_heads(spec, weights.tp)
        slopes, rotate = None, None
        if layout.alibi:
            # The reference rounds the slopes to bfloat16, and adds them before the 1/sqrt(head_dim) scaling.
            slopes = bloom_alibi_slopes(layout.num_heads).bfloat16().float() * self.spec.head_dim**-0.5
            slopes = rank_heads(slopes, layout.num_heads, layout.num_kv_heads, weights.tp).to(weights.device)
        else:
            self.rotary = rotary_embedding(self.spec, rope_parameters(config), weights)
            rotate = self.rotary.rotate_fn
        self.layers = nn.ModuleList(
            FalconDecoderLayer(weights, f"{prefix}h.{i}", config, layout, self.spec, slopes, rotate)
            for i in range(self.spec.num_layers)
        )
        self.norm = load_layer_norm(weights, f"{prefix}ln_f", config.layer_norm_epsilon)
