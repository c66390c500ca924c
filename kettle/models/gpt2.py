"""GPT-2 over a paged KV cache: learned absolute positions, pre-norm LayerNorm blocks, fused c_attn.

GPT-2 checkpoints store every projection as a `Conv1D`, whose weight is [in, out] (the transpose of a
Linear's); they are transposed once at load. OpenAI's original checkpoints are saved without the
"transformer." prefix, transformers' own with it: both load. Under tensor parallelism a rank reads its columns
of a column-parallel Conv1D (c_attn: its heads of each of q, k and v; c_fc) and its rows of a row-parallel one
(the c_projs), so the slices are the transposes of the usual ones.
"""

from __future__ import annotations

import torch
from torch import nn

from kettle.layers.activation import activation
from kettle.layers.linear import Linear
from kettle.layers.parallel import RowParallelLinear, Rows, attention_columns, head_split, scaled, split_range
from kettle.models.blocks import DenseMLP, checkpoint_prefix, load_layer_norm
from kettle.models.decoder import Attention, SequentialBlock
from kettle.models.decoder_lm import CausalLM, decoder_spec
from kettle.models.spec import ModelSpec, shard_heads
from kettle.tensors.weights import Weights


def load_conv1d(weights: Weights, prefix: str) -> Linear:
    """A GPT-2 Conv1D (weight [in, out]) as a Linear (weight [out, in])."""
    if weights.gguf is not None:
        # llama.cpp's converter already stored it transposed, as a Linear: loading it as one keeps a quantized
        # file's blocks (a transposed copy would have to be dense).
        return Linear.load(weights, [prefix])
    weight = weights.get(f"{prefix}.weight").t().contiguous()
    return Linear.from_tensor(weights, weight, weights.get_optional(f"{prefix}.bias"))


def column_conv1d(weights: Weights, prefix: str, outputs: list[Rows]) -> Linear:
    """This rank's `outputs` (blocks of output features, fused in order) of a Conv1D; all of it unsharded."""
    if not weights.tp.sharded:
        return load_conv1d(weights, prefix)
    weight = torch.cat([weights.get_slice(f"{prefix}.weight", 1, *block) for block in outputs], dim=1)
    bias = None
    if weights.has(f"{prefix}.bias"):
        bias = torch.cat([weights.get_slice(f"{prefix}.bias", 0, *block) for block in outputs])
    return Linear(weight.t().contiguous(), bias)


def row_conv1d(weights: Weights, prefix: str, inputs: Rows | None) -> nn.Module:
    """A Conv1D over this rank's block of input features, all-reduced (bias added on rank 0 only)."""
    tp = weights.tp
    if not tp.sharded:
        return load_conv1d(weights, prefix)
    inputs = inputs or split_range(weights.shape(f"{prefix}.weight")[0], tp)
    weight = weights.get_slice(f"{prefix}.weight", 0, *inputs).t().contiguous()
    bias = weights.get_optional(f"{prefix}.bias") if tp.rank == 0 else None
    return RowParallelLinear(Linear(weight, bias), tp)


def attention_scale(config, head_dim: int, layer: int) -> float:
    """1/sqrt(head_dim) unless `scale_attn_weights` is off; divided by layer + 1 when asked (GPT-2 variants)."""
    scale = head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        scale /= layer + 1
    return scale


def gpt2_block(weights: Weights, prefix: str, config, spec: ModelSpec, layer: int) -> SequentialBlock:
    """x + attn(ln_1(x)), then x + mlp(ln_2(x)); attention without RoPE (learned positions)."""
    eps, scale, tp = config.layer_norm_epsilon, attention_scale(config, spec.head_dim, layer), weights.tp
    hidden, heads = config.n_embd, (config.n_head, config.n_head, spec.head_dim)
    q = scaled(head_split(config.n_head, config.n_head, tp).q, spec.head_dim)
    c_attn = column_conv1d(weights, f"{prefix}.attn.c_attn", [(q[0] + i * hidden, q[1] + i * hidden) for i in range(3)])
    c_proj = row_conv1d(weights, f"{prefix}.attn.c_proj", attention_columns(tp, *heads))
    attn = Attention(c_attn, c_proj, spec, None, scale=scale)
    inner = weights.shape(f"{prefix}.mlp.c_fc.weight")[1]
    fc = column_conv1d(weights, f"{prefix}.mlp.c_fc", [split_range(inner, tp)])
    proj = row_conv1d(weights, f"{prefix}.mlp.c_proj", None)
    mlp = DenseMLP(fc, proj, activation(config.activation_function))
    return SequentialBlock(
        load_layer_norm(weights, f"{prefix}.ln_1", eps), attn, load_layer_norm(weights, f"{prefix}.ln_2", eps), mlp
    )


class GPT2ForCausalLM(CausalLM):
    """GPT-2 built directly from a checkpoint's tensors."""

    def __init__(self, config, weights: Weights) -> None:
        super().__init__()
        if getattr(config, "add_cross_attention", False):
            raise ValueError("GPT-2 with cross-attention (an encoder-decoder) is not a causal LM Kettle serves")
        prefix = checkpoint_prefix(weights, "wte.weight", ("transformer.", ""))
        vocab = self.load_embeddings(weights, f"{prefix}wte.weight", "lm_head.weight", config.tie_word_embeddings)
        self.wpe = nn.Parameter(weights.get(f"{prefix}wpe.weight"), requires_grad=False)
        self.spec = shard_heads(decoder_spec(config, weights.dtype, vocab, num_kv_heads=config.n_head), weights.tp)
        self.layers = nn.ModuleList(
            gpt2_block(weights, f"{prefix}h.{i}", config, self.spec, i) for i in range(config.n_layer)
        )
        self.norm = load_layer_norm(weights, f"{prefix}ln_f", config.layer_norm_epsilon)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token embeddings plus learned absolute positions."""
        return super().embed(input_ids, positions) + self.wpe[positions]
