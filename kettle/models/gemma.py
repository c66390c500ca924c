"""Gemma (1) over a paged KV cache: the Llama block with Gemma's three differences.

- Embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype first (as transformers does:
  in bfloat16 the factor itself is a bf16 number).
- RMSNorm scales by (1 + weight): checkpoints store the offset from one. We fold the 1 in once at load.
- The MLP gate uses the tanh approximation of GELU (`gelu_pytorch_tanh`; legacy configs saying "gelu" are
  mapped to it by transformers' config class).
head_dim comes from the config (256 in Gemma 7B, not hidden / heads); the LM head is tied to the embedding.
"""

from __future__ import annotations

import torch

from kettle.layers.norm import RMSNorm
from kettle.models.blocks import GatedMLP
from kettle.models.decoder import PreNormLayer
from kettle.models.decoder_lm import DecoderLM
from kettle.models.hf_config import rope_parameters
from kettle.tensors.weights import Weights


def gemma_norm(weights: Weights, name: str, eps: float) -> RMSNorm:
    """RMSNorm with weight 1 + w, the sum taken in float32 (transformers computes it there) then cast once."""
    weight = weights.get(name)
    return RMSNorm((1.0 + weight.float()).to(weight.dtype), eps)


class GemmaForCausalLM(DecoderLM):
    """Gemma built directly from a checkpoint's tensors."""

    def __init__(self, config, weights: Weights) -> None:
        super().__init__()
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=weights.dtype, device=weights.device)
        self.load_llama_layout(config, weights, rope_parameters(config))
        self.norm = gemma_norm(weights, "model.norm.weight", config.rms_norm_eps)

    def load_layer(self, weights: Weights, prefix: str, config, window: int | None = None) -> PreNormLayer:
        eps, mlp = config.rms_norm_eps, GatedMLP.load(weights, f"{prefix}.mlp", config.hidden_act)
        return self.llama_block(weights, prefix, lambda name: gemma_norm(weights, f"{name}.weight", eps), mlp)
