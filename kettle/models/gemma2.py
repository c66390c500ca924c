"""Gemma 2 over a paged KV cache.

The Llama block with Gemma 2's differences, all read from the config:
- embeddings multiplied by sqrt(hidden_size) rounded to the model dtype (as transformers does);
- RMSNorms scale by (1 + weight), and each block has four: before and after attention, before and after
  the MLP (the "after" norms apply to the branch output, before the residual add);
- attention scaled by query_pre_attn_scalar^-0.5 (not head_dim^-0.5), scores soft-capped
  (cap · tanh(s / cap), `attn_logit_softcapping`), sliding-window attention on the layers `layer_types` mark;
- GELU (tanh approximation) gated MLP; final logits soft-capped (`final_logit_softcapping`).
Tensor parallelism splits heads and the MLP as in Llama; the soft-caps act per head and on the gathered logits.
"""

from __future__ import annotations

import torch
from torch import nn

from kettle.layers.attention import AttentionMetadata
from kettle.models.blocks import GatedMLP, load_attention_projections
from kettle.models.decoder import Attention, BlockPlan
from kettle.models.decoder_lm import CausalLM
from kettle.models.gemma import gemma_norm
from kettle.models.hf_config import layer_rope_parameters
from kettle.models.spec import ModelSpec
from kettle.tensors.weights import Weights


def layer_windows(config) -> list[int | None]:
    """Sliding window per layer: where `layer_types` says so, else (older configs) every even layer."""
    layer_types = getattr(config, "layer_types", None) or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config.num_hidden_layers)
    ]
    return [config.sliding_window if kind == "sliding_attention" else None for kind in layer_types]


class Gemma2DecoderLayer(nn.Module):
    """x + post_attn_norm(attn(input_norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x))); `qk_norms`: per-head
    norms of the queries and keys before RoPE (Gemma 3's)."""

    def __init__(
        self, weights: Weights, prefix: str, config, spec: ModelSpec, window: int | None, rotate, qk_norms=None
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_norm = gemma_norm(weights, f"{prefix}.input_layernorm.weight", eps)
        qkv, o_proj = load_attention_projections(weights, f"{prefix}.self_attn", spec.head_dim)
        self.attn = Attention(
            qkv, o_proj, spec, rotate, window, qk_norms, scale=config.query_pre_attn_scalar**-0.5,
            softcap=config.attn_logit_softcapping,
        )  # fmt: skip
        self.post_attention_norm = gemma_norm(weights, f"{prefix}.post_attention_layernorm.weight", eps)
        self.pre_feedforward_norm = gemma_norm(weights, f"{prefix}.pre_feedforward_layernorm.weight", eps)
        self.mlp = GatedMLP.load(weights, f"{prefix}.mlp", config.hidden_activation)
        self.post_feedforward_norm = gemma_norm(weights, f"{prefix}.post_feedforward_layernorm.weight", eps)

    def forward(self, h, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        h = h + self.post_attention_norm(self.attn(self.input_norm(h), cos, sin, k_cache, v_cache, meta))
        return h + self.post_feedforward_norm(self.mlp(self.pre_feedforward_norm(h)))

    def plan(self) -> BlockPlan:
        """The block in the fused step's terms: sequential, each branch output normed before its add."""
        norms = (self.post_attention_norm, self.post_feedforward_norm)
        return BlockPlan(self.input_norm, self.attn, self.mlp, self.pre_feedforward_norm, False, *norms)


class Gemma2ForCausalLM(CausalLM):
    """Gemma 2 built directly from a checkpoint's tensors."""

    def __init__(self, config, weights: Weights) -> None:
        super().__init__()
        # The factor is rounded to the model dtype before the multiply, as in transformers.
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=weights.dtype, device=weights.device)
        self.final_softcap = config.final_logit_softcapping
        self.load_llama_layout(config, weights, layer_rope_parameters(config), layer_windows(config))
        self.norm = gemma_norm(weights, "model.norm.weight", config.rms_norm_eps)

    def load_layer(self, weights: Weights, prefix: str, config, window: int | None) -> Gemma2DecoderLayer:
        return Gemma2DecoderLayer(weights, prefix, config, self.spec, window, self.rotary.rotate_fn)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] → logits [N, vocab] in float32, soft-capped when the config says so."""
        logits = super().compute_logits(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
