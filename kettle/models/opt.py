"""OPT (and Galactica, which is OPT) over a paged KV cache.

Learned absolute positions read at position + 2 (OPT reserves the first two rows), separate q/k/v
projections fused at load, ReLU MLP. Two layouts: pre-norm (`do_layer_norm_before`, every size but 350m)
and post-norm (350m, which also projects embeddings in and hidden states out through
`word_embed_proj_dim`). Galactica adds nothing beyond config values (GELU, no biases are read as absent).
"""

from __future__ import annotations

import torch
from torch import nn

from kettle.layers.attention import AttentionMetadata
from kettle.layers.linear import Linear
from kettle.layers.norm import LayerNorm
from kettle.models.blocks import DenseMLP, checkpoint_prefix, load_attention_projections
from kettle.models.decoder import Attention, BlockPlan, SequentialBlock
from kettle.models.decoder_lm import CausalLM, decoder_spec
from kettle.models.spec import ModelSpec, shard_heads
from kettle.tensors.weights import Weights

POSITION_OFFSET = 2  # OPT's learned position table starts two rows in (a fairseq legacy)
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which OPT uses


def load_norm(weights: Weights, name: str, config) -> LayerNorm:
    """A LayerNorm; checkpoints with `layer_norm_elementwise_affine=False` store no weights (identity affine)."""
    if getattr(config, "layer_norm_elementwise_affine", True):
        return LayerNorm(weights.get(f"{name}.weight"), weights.get_optional(f"{name}.bias"), LAYER_NORM_EPS)
    ones = torch.ones(config.hidden_size, dtype=weights.dtype, device=weights.device)
    return LayerNorm(ones, None, LAYER_NORM_EPS)


class OPTDecoderLayer(SequentialBlock):
    """Pre-norm: x + attn(ln(x)), x + fc(ln(x)). Post-norm (350m): ln(x + attn(x)), ln(x + fc(x))."""

    def __init__(self, weights: Weights, prefix: str, config, spec: ModelSpec) -> None:
        names = ("q_proj", "k_proj", "v_proj", "out_proj")
        qkv, out_proj = load_attention_projections(weights, f"{prefix}.self_attn", spec.head_dim, names)
        super().__init__(
            load_norm(weights, f"{prefix}.self_attn_layer_norm", config),
            Attention(qkv, out_proj, spec, None),
            load_norm(weights, f"{prefix}.final_layer_norm", config),
            DenseMLP.load(weights, f"{prefix}.fc1", f"{prefix}.fc2", config.activation_function),
        )
        self.pre_norm = config.do_layer_norm_before

    def forward(self, h, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if self.pre_norm:
            return super().forward(h, cos, sin, k_cache, v_cache, meta)
        h = self.input_norm(h + self.attn(h, cos, sin, k_cache, v_cache, meta))
        return self.post_attention_norm(h + self.mlp(h))

    def plan(self) -> BlockPlan | None:
        """The pre-norm block in the fused step's terms; the post-norm one (350m) is not described."""
        return BlockPlan(self.input_norm, self.attn, self.mlp, self.post_attention_norm) if self.pre_norm else None


class OPTForCausalLM(CausalLM):
    """OPT built directly from a checkpoint's tensors."""

    def __init__(self, config, weights: Weights) -> None:
        super().__init__()
        prefix = checkpoint_prefix(weights, "embed_tokens.weight", ("model.decoder.", "decoder."))
        tied = getattr(config, "tie_word_embeddings", True)
        vocab = self.load_embeddings(weights, f"{prefix}embed_tokens.weight", "lm_head.weight", tied)
        self.embed_positions = nn.Parameter(weights.get(f"{prefix}embed_positions.weight"), requires_grad=False)
        # 350m: embeddings live in word_embed_proj_dim and are projected in and out of the hidden size.
        self.project_in = self._optional_linear(weights, f"{prefix}project_in")
        self.project_out = self._optional_linear(weights, f"{prefix}project_out")
        spec = decoder_spec(config, weights.dtype, vocab, num_kv_heads=config.num_attention_heads)
        self.spec = shard_heads(spec, weights.tp)
        self.layers = nn.ModuleList(
            OPTDecoderLayer(weights, f"{prefix}layers.{i}", config, self.spec) for i in range(config.num_hidden_layers)
        )
        final = config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)
        self.norm = load_norm(weights, f"{prefix}final_layer_norm", config) if final else None

    @staticmethod
    def _optional_linear(weights: Weights, prefix: str) -> Linear | None:
        return Linear.load(weights, [prefix]) if weights.has(f"{prefix}.weight") else None

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token embeddings (projected in on 350m) plus learned positions, read two rows in."""
        h = super().embed(input_ids, positions)
        if self.project_in is not None:
            h = self.project_in(h)
        return h + self.embed_positions[positions + POSITION_OFFSET]

    def finish(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm (pre-norm layout) and the 350m's projection out to word_embed_proj_dim."""
        if self.norm is not None:
            h = self.norm(h)
        return h if self.project_out is None else self.project_out(h)
