"""Qwen3 (dense) over a paged KV cache: the Llama block plus an RMSNorm on each query and key head.

The per-head norms (`q_norm`, `k_norm`, over head_dim) run after the projections and before RoPE, as in
transformers. head_dim comes from the config (it is not hidden / heads in Qwen3), and sliding-window
layers follow `layer_types` when `use_sliding_window` is set.
"""

from __future__ import annotations

from torch import nn

from kettle.models.decoder_lm import NormLoader
from kettle.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 built directly from a checkpoint's tensors."""

    def load_qk_norms(self, norm: NormLoader, prefix: str) -> tuple[nn.Module, nn.Module]:
        return norm(f"{prefix}.self_attn.q_norm"), norm(f"{prefix}.self_attn.k_norm")
