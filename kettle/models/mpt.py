"""MPT (MosaicML) over a paged KV cache: ALiBi, fused Wqkv with optional clipping, LayerNorms and
projections without biases by default (`no_bias`; biases present in a checkpoint are applied).

Only the configuration Hugging Face's MPT implements is accepted (multi-head attention with ALiBi, no
q/k LayerNorm, no prefix-LM, no logit scaling); anything else is refused by name rather than run wrong.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kettle.layers.alibi import mpt_alibi_slopes
from kettle.layers.parallel import ColumnParallelLinear, RowParallelLinear, attention_columns, rank_heads
from kettle.models.blocks import DenseMLP, checkpoint_prefix, load_layer_norm
from kettle.models.decoder import Attention, SequentialBlock
from kettle.models.decoder_lm import CausalLM, decoder_spec
from kettle.models.spec import ModelSpec, shard_heads
from kettle.tensors.weights import LinearLoader, Weights


def check_supported(config) -> None:
    """Refuses MPT options this implementation (like Hugging Face's) does not have."""
    attn = config.attn_config
    unsupported = {
        "attn_config.alibi=False (learned positions)": not attn.alibi,
        "attn_config.qk_ln": attn.qk_ln,
        "attn_config.prefix_lm": attn.prefix_lm,
        f"attn_config.attn_type={attn.attn_type!r}": attn.attn_type != "multihead_attention",
        f"logit_scale={config.logit_scale!r}": config.logit_scale is not None,
    }
    refused = [name for name, present in unsupported.items() if present]
    if refused:
        raise ValueError(f"MPT with {', '.join(refused)} is not supported")


def mpt_block(weights: Weights, prefix: str, config, spec: ModelSpec, slopes: torch.Tensor) -> SequentialBlock:
    """x + attn(norm_1(x)), then x + ffn(norm_2(x)) with an exact-GELU MLP; attention reads Wqkv (clamped to
    ±clip_qkv when set) and adds ALiBi instead of positions."""
    eps, attn, heads = config.layer_norm_epsilon, f"{prefix}.attn", (config.n_heads, config.n_heads, spec.head_dim)
    attention = Attention(
        ColumnParallelLinear.load_fused_qkv(weights, f"{attn}.Wqkv", *heads),
        RowParallelLinear.load(weights, f"{attn}.out_proj", attention_columns(weights.tp, *heads)), spec, None,
        scale=config.attn_config.softmax_scale or spec.head_dim**-0.5, alibi_slopes=slopes,
        clip=config.attn_config.clip_qkv,
    )  # fmt: skip
    up = ColumnParallelLinear.load(weights, [f"{prefix}.ffn.up_proj"])
    down = RowParallelLinear.load(weights, f"{prefix}.ffn.down_proj")
    return SequentialBlock(
        load_layer_norm(weights, f"{prefix}.norm_1", eps),
        attention,
        load_layer_norm(weights, f"{prefix}.norm_2", eps),
        DenseMLP(up, down, F.gelu),
    )


class MptForCausalLM(CausalLM):
    """MPT built directly from a checkpoint's tensors."""

    def __init__(self, config, weights: Weights) -> None:
        super().__init__()
        check_supported(config)
        prefix = checkpoint_prefix(weights, "wte.weight", ("transformer.", ""))
        tied = getattr(config, "tie_word_embeddings", True)
        vocab = self.load_embeddings(weights, f"{prefix}wte.weight", "lm_head.weight", tied)
        spec = decoder_spec(
            config, weights.dtype, vocab, num_kv_heads=config.n_heads, max_position_embeddings=config.max_seq_len
        )
        self.spec = shard_heads(spec, weights.tp)
        heads = config.n_heads  # each rank adds the slopes of its own heads
        slopes = rank_heads(mpt_alibi_slopes(heads, config.attn_config.alibi_bias_max), heads, heads, weights.tp)
        slopes = slopes.to(weights.device)
        self.layers = nn.ModuleList(
            mpt_block(weights, f"{prefix}blocks.{i}", config, self.spec, slopes) for i in range(config.n_layers)
        )
        self.norm = load_layer_norm(weights, f"{prefix}norm_f", config.layer_norm_epsilon)

    @classmethod
    def from_pretrained(
        cls, path: str, config, dtype: torch.dtype, device: torch.device, quantize: LinearLoader | None = None
    ) -> MptForCausalLM:
        check_supported(config)  # before reading any tensor
        return super().from_pretrained(path, config, dtype, device, quantize)
