"""StarCoder2 over a paged KV cache: a pre-norm RoPE block with LayerNorms (with biases), grouped-query
attention with biased projections, a plain c_fc → GELU (tanh) → c_proj MLP, and a sliding window.

`use_bias` (default on) gives every projection a bias; they load when the checkpoint has them. The LM head
is tied to the embedding unless the config says otherwise.
"""

from __future__ import annotations

from kettle.models.blocks import DenseMLP, load_layer_norm
from kettle.models.decoder import PreNormLayer
from kettle.models.decoder_lm import DecoderLM
from kettle.models.hf_config import rope_parameters
from kettle.tensors.weights import Weights


class Starcoder2ForCausalLM(DecoderLM):
    """StarCoder2 built directly from a checkpoint's tensors."""

    def __init__(self, config, weights: Weights) -> None:
        super().__init__()
        windows = [getattr(config, "sliding_window", None)] * config.num_hidden_layers
        self.load_llama_layout(config, weights, rope_parameters(config), windows)
        self.norm = load_layer_norm(weights, "model.norm", config.norm_epsilon)

    def load_layer(self, weights: Weights, prefix: str, config, window: int | None) -> PreNormLayer:
        eps, mlp = config.norm_epsilon, f"{prefix}.mlp"
        feed_forward = DenseMLP.load(weights, f"{mlp}.c_fc", f"{mlp}.c_proj", config.hidden_act)
        return self.llama_block(weights, prefix, lambda name: load_layer_norm(weights, name, eps), feed_forward, window)
