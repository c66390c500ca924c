"""The Llama family: Llama 2/3/3.1, Code Llama, TinyLlama, SmolLM, Mistral and Qwen2, over a paged KV cache.

A pre-norm block of RMSNorms, RoPE attention with grouped-query heads and a SiLU-gated MLP, all shared
blocks (`DecoderLM.llama_block`, `GatedMLP`). The variants differ only in facts read from the config and the
checkpoint: biases on q/k/v (Qwen2; loaded when the checkpoint has them), sliding-window layers (Mistral,
some Qwen2), the RoPE scaling, and tied embeddings. Tensor parallelism and the fused CPU decode step come
with the shared blocks.
"""

from __future__ import annotations

from torch import nn

from kettle.layers.norm import RMSNorm
from kettle.models.blocks import GatedMLP, rms_norm_loader
from kettle.models.decoder import PreNormLayer
from kettle.models.decoder_lm import DecoderLM, NormLoader
from kettle.models.hf_config import layer_windows, rope_parameters
from kettle.tensors.weights import Weights


class LlamaForCausalLM(DecoderLM):
    """A Llama-family causal LM built directly from a checkpoint's tensors (no random init, no copy)."""

    def __init__(self, config, weights: Weights) -> None:
        super().__init__()
        self.load_llama_layout(config, weights, rope_parameters(config), layer_windows(config))
        self.norm = RMSNorm(weights.get("model.norm.weight"), config.rms_norm_eps)

    def load_layer(self, weights: Weights, prefix: str, config, window: int | None) -> PreNormLayer:
        norm = rms_norm_loader(weights, config.rms_norm_eps)
        mlp, qk_norms = self.load_mlp(weights, prefix, config), self.load_qk_norms(norm, prefix)
        return self.llama_block(weights, prefix, norm, mlp, window, qk_norms)

    def load_mlp(self, weights: Weights, prefix: str, config) -> nn.Module:
        """The block's MLP: SiLU-gated (Mixtral routes tokens to experts instead)."""
        return GatedMLP.load(weights, f"{prefix}.mlp", config.hidden_act)

    def load_qk_norms(self, norm: NormLoader, prefix: str) -> tuple[nn.Module, nn.Module] | None:
        """Per-head RMSNorms on queries and keys: none here (Qwen3 has them)."""
        return None
