"""Phi (Phi-1, Phi-1.5, Phi-2) over a paged KV cache: a parallel block with partial rotary embeddings.

Each layer reads one LayerNorm of its input and adds attention and MLP outputs to the residual side by side:
x + attn(ln(x)) + mlp(ln(x)). RoPE rotates only the first `partial_rotary_factor` of each head (0.4 in
Phi-2, 0.5 in Phi-1/1.5); the rest passes through. Projections carry biases (the output one is `dense`), the
MLP is fc1 → gelu_new → fc2, a final LayerNorm precedes the LM head, which has a bias too.
`qk_layernorm` checkpoints get a LayerNorm over each query and key head before RoPE, as transformers does.
"""

from __future__ import annotations

from kettle.models.blocks import DenseMLP, load_attention_projections, load_layer_norm
from kettle.models.decoder import Attention, ParallelLayer
from kettle.models.decoder_lm import DecoderLM
from kettle.models.hf_config import rope_parameters
from kettle.tensors.weights import Weights


class PhiForCausalLM(DecoderLM):
    """Phi built directly from a checkpoint's tensors."""

    def __init__(self, config, weights: Weights) -> None:
        super().__init__()
        self.load_llama_layout(config, weights, rope_parameters(config), head_bias="lm_head.bias")
        self.norm = load_layer_norm(weights, "model.final_layernorm", config.layer_norm_eps)

    def load_layer(self, weights: Weights, prefix: str, config, window: int | None = None) -> ParallelLayer:
        eps, attn, mlp = config.layer_norm_eps, f"{prefix}.self_attn", f"{prefix}.mlp"
        qk_norms = None
        if getattr(config, "qk_layernorm", False):
            qk_norms = (
                load_layer_norm(weights, f"{attn}.q_layernorm", eps),
                load_layer_norm(weights, f"{attn}.k_layernorm", eps),
            )
        names = ("q_proj", "k_proj", "v_proj", "dense")
        qkv, dense = load_attention_projections(weights, attn, self.spec.head_dim, names)
        attention = Attention(qkv, dense, self.spec, self.rotary.rotate_fn, qk_norms=qk_norms)
        feed_forward = DenseMLP.load(weights, f"{mlp}.fc1", f"{mlp}.fc2", config.hidden_act)
        return ParallelLayer(load_layer_norm(weights, f"{prefix}.input_layernorm", eps), attention, feed_forward)
