"""Gemma 3's language model (`Gemma3ForCausalLM`, model type `gemma3_text`) over a paged KV cache.

Gemma 2's block (kettle/models/gemma2.py: four norms per block, embeddings x sqrt(hidden), scores scaled by
query_pre_attn_scalar^-0.5, sliding windows on the layers `layer_types` mark) with Gemma 3's differences, all read
from the config:
- an RMSNorm with (1 + weight) on each query and key head, after the projections and before RoPE;
- two RoPE tables: sliding layers rotate with the local base (`rope_local_base_freq`, transformers 5's
  `rope_parameters["sliding_attention"]`), full layers with the global one and its own scaling (linear, factor 8
  in the 4B-27B checkpoints), each layer given its table's cos and sin (`CausalLM.layer_rotary`);
- no soft-capping unless the config sets it (`attn_logit_softcapping`, `final_logit_softcapping` are None).
The fused CPU decode step takes both tables each step, each layer rotating with its own
(kettle/models/decoder_step.py).
"""

from __future__ import annotations

from kettle.models.gemma import gemma_norm
from kettle.models.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM
from kettle.tensors.weights import Weights


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text model built directly from a checkpoint's tensors."""

    def __init__(self, config, weights: Weights) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            # EmbeddingGemma's encoder: every text token sees every other, which a generating model never does.
            raise ValueError("Gemma 3 with use_bidirectional_attention (an embedding model) is not supported")
        super().__init__(config, weights)

    def load_layer(self, weights: Weights, prefix: str, config, window: int | None) -> Gemma2DecoderLayer:
        eps, attn = config.rms_norm_eps, f"{prefix}.self_attn"
        qk_norms = gemma_norm(weights, f"{attn}.q_norm.weight", eps), gemma_norm(weights, f"{attn}.k_norm.weight", eps)
        return Gemma2DecoderLayer(weights, prefix, config, self.spec, window, self.rotary.rotate_fn, qk_norms)
