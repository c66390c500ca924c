"""GPT-J over a paged KV cache: a parallel block with interleaved partial rotary embeddings.

Each layer reads one LayerNorm (`ln_1`) and adds attention and MLP outputs side by side:
x + attn(ln_1(x)) + mlp(ln_1(x)). RoPE rotates only the first `rotary_dim` dimensions of each head (64 of 256
in GPT-J 6B), and pairs neighbouring dimensions (2i, 2i+1: `rotate_every_two`) rather than the two halves,
with base 10000. Attention projections have no biases; the MLP (fc_in → gelu_new → fc_out) and the LM head do.
Multi-head attention: as many KV heads as query heads.
"""

from __future__ import annotations

from torch import nn

from kettle.models.blocks import DenseMLP, load_attention_projections, load_layer_norm
from kettle.models.decoder import Attention, ParallelLayer
from kettle.models.decoder_lm import DecoderLM, decoder_spec, rotary_embedding
from kettle.models.spec import shard_heads
from kettle.tensors.weights import Weights


class GPTJForCausalLM(DecoderLM):
    """GPT-J built directly from a checkpoint's tensors."""

    def __init__(self, config, weights: Weights) -> None:
        super().__init__()
        tied = getattr(config, "tie_word_embeddings", False)
        vocab = self.load_embeddings(weights, "transformer.wte.weight", "lm_head.weight", tied, "lm_head.bias")
        windows = [None] * config.n_layer
        spec = decoder_spec(config, weights.dtype, vocab, windows, num_kv_heads=config.n_head)
        self.spec = shard_heads(spec, weights.tp)
        rotary_dim = config.rotary_dim or self.spec.head_dim
        rope = {"rope_theta": 10000.0}
        self.rotary = rotary_embedding(self.spec, rope, weights, rotary_dim=rotary_dim, interleaved=True)
        self.layers = nn.ModuleList(self._layer(weights, f"transformer.h.{i}", config) for i in range(config.n_layer))
        self.norm = load_layer_norm(weights, "transformer.ln_f", config.layer_norm_epsilon)

    def _layer(self, weights: Weights, prefix: str, config) -> ParallelLayer:
        attn, mlp = f"{prefix}.attn", f"{prefix}.mlp"
        names = ("q_proj", "k_proj", "v_proj", "out_proj")
        qkv, out_proj = load_attention_projections(weights, attn, self.spec.head_dim, names)
        attention = Attention(qkv, out_proj, self.spec, self.rotary.rotate_fn)
        feed_forward = DenseMLP.load(weights, f"{mlp}.fc_in", f"{mlp}.fc_out", config.activation_function)
        return ParallelLayer(
            load_layer_norm(weights, f"{prefix}.ln_1", config.layer_norm_epsilon), attention, feed_forward
        )
