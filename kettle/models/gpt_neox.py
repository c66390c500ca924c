"""GPT-NeoX (Pythia, GPT-NeoX-20B, Dolly v2, StableLM alpha) over a paged KV cache.

- The checkpoint's `query_key_value` projection interleaves q, k and v per head (rows [head][q|k|v][dim]);
  we regroup its rows once at load into [q heads; k heads; v heads], the fused layout our attention reads.
- RoPE rotates the first `rotary_pct` of each head (0.25 in Pythia), halves layout (transformers' config
  class turns v4's `rotary_pct` / `rotary_emb_base` into `rope_parameters`).
- `use_parallel_residual` (Pythia: on) gives x + attn(ln1(x)) + mlp(ln2(x)); off, the usual sequential
  pre-norm block. Every projection has a bias; the LM head (`embed_out`) does not.
Multi-head attention: as many KV heads as query heads; under tensor parallelism a rank's heads are one
contiguous block of query_key_value's rows.
"""

from __future__ import annotations

from torch import nn

from kettle.models.blocks import DenseMLP, load_layer_norm, load_per_head_attention
from kettle.models.decoder import Attention, ParallelLayer, PreNormLayer
from kettle.models.decoder_lm import DecoderLM, decoder_spec, rotary_embedding
from kettle.models.hf_config import rope_parameters
from kettle.models.spec import shard_heads
from kettle.tensors.weights import Weights


class GPTNeoXForCausalLM(DecoderLM):
    """GPT-NeoX built directly from a checkpoint's tensors."""

    def __init__(self, config, weights: Weights) -> None:
        super().__init__()
        tied = getattr(config, "tie_word_embeddings", False)
        vocab = self.load_embeddings(weights, "gpt_neox.embed_in.weight", "embed_out.weight", tied)
        windows = [None] * config.num_hidden_layers
        heads = config.num_attention_heads
        self.spec = shard_heads(decoder_spec(config, weights.dtype, vocab, windows, num_kv_heads=heads), weights.tp)
        self.rotary = rotary_embedding(self.spec, rope_parameters(config), weights)
        self.layers = nn.ModuleList(
            self._layer(weights, f"gpt_neox.layers.{i}", config) for i in range(config.num_hidden_layers)
        )
        self.norm = load_layer_norm(weights, "gpt_neox.final_layer_norm", config.layer_norm_eps)

    def _layer(self, weights: Weights, prefix: str, config) -> nn.Module:
        eps, attn, mlp = config.layer_norm_eps, f"{prefix}.attention", f"{prefix}.mlp"
        heads, head_dim = config.num_attention_heads, self.spec.head_dim
        qkv, dense = load_per_head_attention(weights, f"{attn}.query_key_value", f"{attn}.dense", heads, head_dim)
        attention = Attention(qkv, dense, self.spec, self.rotary.rotate_fn)
        feed_forward = DenseMLP.load(weights, f"{mlp}.dense_h_to_4h", f"{mlp}.dense_4h_to_h", config.hidden_act)
        input_norm = load_layer_norm(weights, f"{prefix}.input_layernorm", eps)
        post_norm = load_layer_norm(weights, f"{prefix}.post_attention_layernorm", eps)
        if config.use_parallel_residual:
            return ParallelLayer(input_norm, attention, feed_forward, mlp_norm=post_norm)
        return PreNormLayer(input_norm, attention, post_norm, feed_forward)
