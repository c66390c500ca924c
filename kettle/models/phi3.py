"""Phi-3 (mini, small, medium; Phi-3.5 mini) over a paged KV cache: the Llama block with fused projections.

Checkpoints store q/k/v as one `qkv_proj` ([q; k; v] rows, our fused layout already) and gate/up as one
`gate_up_proj`, so nothing is concatenated at load. RoPE may be "longrope" (called "su" by the first
checkpoints): per-frequency short factors up to `original_max_position_embeddings`, long factors for
sequences past it, and cos/sin scaled by the attention factor (kettle/layers/rotary.py). A partial rotary
factor, when the config has one, rotates the first part of each head. `sliding_window` applies to every layer.
Under tensor parallelism each rank cuts its heads out of each of q, k and v, and its rows out of gate and up.
"""

from __future__ import annotations

from kettle.layers.norm import RMSNorm
from kettle.layers.parallel import ColumnParallelLinear, RowParallelLinear, attention_columns
from kettle.models.blocks import GatedMLP
from kettle.models.decoder import Attention, PreNormLayer
from kettle.models.decoder_lm import DecoderLM
from kettle.models.hf_config import rope_parameters
from kettle.tensors.weights import Weights


def phi3_rope_parameters(config) -> dict:
    """The config's RoPE settings, with the trained length longrope needs even where the dict lacks it."""
    params = rope_parameters(config)
    original = getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings
    params.setdefault("original_max_position_embeddings", original)
    return params


class Phi3ForCausalLM(DecoderLM):
    """Phi-3 built directly from a checkpoint's tensors."""

    def __init__(self, config, weights: Weights) -> None:
        super().__init__()
        windows = [getattr(config, "sliding_window", None)] * config.num_hidden_layers
        self.load_llama_layout(config, weights, phi3_rope_parameters(config), windows)
        self.norm = RMSNorm(weights.get("model.norm.weight"), config.rms_norm_eps)

    def load_layer(self, weights: Weights, prefix: str, config, window: int | None) -> PreNormLayer:
        eps, attn, mlp = config.rms_norm_eps, f"{prefix}.self_attn", f"{prefix}.mlp"
        heads = (config.num_attention_heads, config.num_key_value_heads, self.spec.head_dim)
        attention = Attention(
            ColumnParallelLinear.load_fused_qkv(weights, f"{attn}.qkv_proj", *heads),
            RowParallelLinear.load(weights, f"{attn}.o_proj", attention_columns(weights.tp, *heads)),
            self.spec,
            self.rotary.rotate_fn,
            window,
        )
        gated = GatedMLP.load_fused(weights, f"{mlp}.gate_up_proj", f"{mlp}.down_proj", config.hidden_act)
        return PreNormLayer(
            RMSNorm(weights.get(f"{prefix}.input_layernorm.weight"), eps),
            attention,
            RMSNorm(weights.get(f"{prefix}.post_attention_layernorm.weight"), eps),
            gated,
        )
