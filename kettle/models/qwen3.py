"""Qwen3 (dense) over a paged KV cache: the Llama block plus an RMSNorm on each query and key head.

The per-head norms (`q_norm`, `k_norm`, over head_dim) run after the projections and before RoPE, as in
transformers. head_dim comes from the config (it is not hidden / heads in Qwen3), and sliding-window
layers follow `layer_types` when `use_sliding_window` is set.
"""

from __future__ import annotations

from kettle.layers.norm import RMSNorm
from kettle.models.blocks import GatedMLP, rms_norm_loader
from kettle.models.decoder import PreNormLayer
from kettle.models.decoder_lm import DecoderLM
from kettle.models.llama import layer_windows, rope_parameters
from kettle.models.weights import Weights


class Qwen3ForCausalLM(DecoderLM):
    """Qwen3 built directly from a checkpoint's tensors."""

    def __init__(self, config, weights: Weights) -> None:
        super().__init__()
        self.load_llama_layout(config, weights, rope_parameters(config), layer_windows(config))
        self.norm = RMSNorm(weights.get("model.norm.weight"), config.rms_norm_eps)

    def load_layer(self, weights: Weights, prefix: str, config, window: int | None) -> PreNormLayer:
        norm = rms_norm_loader(weights, config.rms_norm_eps)
        qk_norms = (norm(f"{prefix}.self_attn.q_norm"), norm(f"{prefix}.self_attn.k_norm"))
        mlp = GatedMLP.load(weights, f"{prefix}.mlp", config.hidden_act)
        return self.llama_block(weights, prefix, norm, mlp, window, qk_norms)
