"""The causal-LM shell shared by every native family: embedding, layers over the paged KV cache, final norm,
and an LM head (tied or not, with or without a bias; vocabulary-parallel under tensor parallelism).

A family subclass reads its checkpoint names and config facts in `__init__` (`load_embeddings`, then `spec`,
`layers`, `norm` and, with RoPE, `rotary`) and inherits `from_pretrained`, the forward and the float32 logits.
A model whose layers rotate with different RoPE settings (Gemma 3's local and global bases) also has
`layer_rotary`, each layer's table (`load_rotary` builds both from one settings dict per layer).
`CausalLM` drives layers that add their own residuals; `DecoderLM` drives layers that carry the residual
stream to the next norm (kettle/models/decoder.py). Hooks: `embed` (learned positions, scaling, a norm) and
`finish` (what follows the last layer). `load_llama_layout` and `llama_block` build the parts that
families saved in Llama's naming share.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import nn

from kettle.kernels import ops
from kettle.layers.attention import AttentionMetadata
from kettle.layers.linear import Linear
from kettle.layers.lora import LoraRows
from kettle.layers.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    load_vocab_parallel,
    query_columns,
    vocab_parallel_embedding,
    vocab_parallel_head,
    vocab_rows,
)
from kettle.layers.rotary import RotaryEmbedding
from kettle.models.decoder import Attention, PreNormLayer
from kettle.models.decoder_step import DecoderStep
from kettle.models.spec import ModelSpec, shard_heads
from kettle.models.vision.image_rows import ImageRows
from kettle.tensors.kv_cache import KVCache
from kettle.tensors.weights import LinearLoader, Weights

NormLoader = Callable[[str], nn.Module]  # checkpoint name (without ".weight") → the norm


def decoder_spec(config, dtype: torch.dtype, vocab_size: int, windows=(None,), **given) -> ModelSpec:
    """A ModelSpec from the config's standard names (transformers maps GPT-2's n_head, n_layer... onto them);
    `given` overrides any field a family names differently or fixes (e.g. num_kv_heads=1 for multi-query)."""
    heads = given.pop("num_heads", None) or config.num_attention_heads
    facts = {
        "num_layers": given.pop("num_layers", None) or config.num_hidden_layers,
        "num_kv_heads": given.pop("num_kv_heads", None) or getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": given.pop("head_dim", None) or getattr(config, "head_dim", None) or config.hidden_size // heads,
        "max_position_embeddings": given.pop("max_position_embeddings", None) or config.max_position_embeddings,
    }
    return ModelSpec(
        model_type=config.model_type,
        num_heads=heads,
        hidden_size=config.hidden_size,
        vocab_size=vocab_size,
        sliding_window=windows[0] if len(set(windows)) == 1 else None,
        dtype=dtype,
        **facts,
        **given,
    )


def rotary_embedding(spec: ModelSpec, params: dict, weights: Weights, **options) -> RotaryEmbedding:
    """RoPE tables over the spec's head size and trained length, in the model's dtype and device."""
    return RotaryEmbedding(
        spec.head_dim, params, spec.max_position_embeddings, weights.dtype, weights.device, **options
    )


class CausalLM(nn.Module):
    """Embedding → layers (each `layer(h, cos, sin, k_cache, v_cache, meta) → h`) → final norm → LM head.
    Where every block's `plan()` is one Kettle's fused CPU decode step runs, decode-only steps take that one
    call instead of the layers (kettle/models/decoder_step.py)."""

    spec: ModelSpec
    rotary: RotaryEmbedding | None = None  # None: no RoPE (learned positions or ALiBi)
    # Each layer's table where the layers rotate with different settings (the shared `rotary` is then the first
    # layer's); None: every layer rotates with `rotary`.
    layer_rotary: list[RotaryEmbedding] | None = None
    # A token whose contiguous runs in a prompt attend to each other both ways (Gemma 3's image tokens); None: none.
    both_ways_token: int | None = None
    embed_scale: torch.Tensor | None = None  # Gemma multiplies embeddings by sqrt(hidden)
    lora_rows: LoraRows | None = None  # set when LoRA adapters are attached (kettle/models/lora_adapters.py)
    # A vision-language model's image embeddings for its next forward, put in place of its image tokens' rows
    # (kettle/models/vision/image_rows.py; the shard's runner sets them).
    image_rows: ImageRows | None = None
    embed_rows = None  # ids → rows, when the embedding reads a quantized table (a tied head's or its own)

    def load_embeddings(self, weights: Weights, embed: str, head: str, tied: bool, head_bias: str | None = None):
        """Loads the input embedding and the LM head and returns the vocabulary size; tied, the embedding reads
        the head's storage (no copy). Under tensor parallelism each rank holds a block of the vocabulary."""
        self.tp = weights.tp
        if head_bias is None and (table := weights.quantized_vocabulary(embed, head)) is not None:
            # The file's own quantized table serves the head and the embedding's rows: no float32 copy of it.
            self.lm_head, self.embed_rows = table, table.embed
            self.register_buffer("embed_tokens", None, persistent=False)
            return table.out_features
        if not tied and (table := weights.quantized_embedding(embed, head)) is not None:
            # An untied table the file stores quantized stays so, its rows dequantized as they are looked up; the
            # head is a projection of its own ("lm_head.weight", "lm_head.bias"), loaded from its blocks as one.
            self.embed_table, self.embed_rows = table, table.embed  # a submodule: its tensors count as the model's
            self.register_buffer("embed_tokens", None, persistent=False)
            self.lm_head = Linear.load(weights, [head.removesuffix(".weight")])
            return int(weights.shape(head)[0])
        embed_weight, head_weight, vocab_size = load_vocab_parallel(weights, embed, head, tied)
        # A head's bias goes with its vocabulary rows (this rank's block of it under tensor parallelism).
        bias = vocab_rows(weights, head_bias) if head_bias and weights.has(head_bias) else None
        self.lm_head = vocab_parallel_head(head_weight, vocab_size, self.tp, bias)
        # A oneDNN-packed head has no row view, so there the embedding keeps the checkpoint tensor.
        shared = head_weight is embed_weight and self.lm_head.layout != "onednn"
        self.register_buffer("embed_tokens", self.lm_head.dense_weight if shared else embed_weight, persistent=False)
        return vocab_size

    def load_llama_layout(
        self,
        config,
        weights: Weights,
        rope: dict | Sequence[dict],
        windows: list[int | None] | None = None,
        head_bias: str | None = None,
    ) -> None:
        """Embeddings, spec, RoPE and layers of a checkpoint laid out like Llama's ("model.embed_tokens",
        "lm_head", "model.layers.{i}"); each layer comes from the family's `load_layer(weights, prefix, config,
        window)`. The family then loads its final `norm`. `rope`: the RoPE settings, or each layer's
        (`load_rotary`); `windows`: each layer's sliding window (default none)."""
        windows = windows or [None] * config.num_hidden_layers
        tied = getattr(config, "tie_word_embeddings", True)
        vocab = self.load_embeddings(weights, "model.embed_tokens.weight", "lm_head.weight", tied, head_bias)
        # Under tensor parallelism the spec counts this rank's heads (the KV cache is sized from it).
        self.spec = shard_heads(decoder_spec(config, weights.dtype, vocab, windows), weights.tp)
        self.load_rotary(rope, weights)
        self.layers = nn.ModuleList(
            self.load_layer(weights, f"model.layers.{i}", config, window) for i, window in enumerate(windows)
        )

    def load_rotary(self, rope: dict | Sequence[dict], weights: Weights) -> None:
        """`rotary` from one dict of RoPE settings; from one per layer, a table per distinct dict and
        `layer_rotary` (when they differ). The layers keep one rotation function, the shared table's: every table
        rotates the same part of the head in the same layout, only the angles differ, and they come per layer with
        the step's cos and sin (`layer_ropes`)."""
        if isinstance(rope, dict):
            self.rotary = rotary_embedding(self.spec, rope, weights)
            return
        distinct: list[tuple[dict, RotaryEmbedding]] = []
        for params in rope:
            if not any(params == seen for seen, _ in distinct):
                distinct.append((params, rotary_embedding(self.spec, params, weights)))
        self.rotary = distinct[0][1]
        if len(distinct) > 1:
            if len({(table.rotary_dim, table.interleaved) for _, table in distinct}) > 1:
                raise ValueError("per-layer RoPE settings that rotate different parts of the head are not supported")
            self.layer_rotary = [next(table for seen, table in distinct if seen == params) for params in rope]

    def load_layer(self, weights: Weights, prefix: str, config, window: int | None) -> nn.Module:
        """One layer under `prefix` (families that use `load_llama_layout` say how)."""
        raise NotImplementedError(f"{type(self).__name__} builds its layers itself")

    @classmethod
    def from_pretrained(
        cls, path: str, config, dtype: torch.dtype, device: torch.device, quantize: LinearLoader | None = None
    ) -> CausalLM:
        """Loads the checkpoint in `path` (safetensors) for an already parsed transformers `config`; `quantize`
        loads each projection under a quantization scheme (`Weights`)."""
        with Weights(path, dtype, device, quantize) as weights:
            return cls(config, weights).eval()

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T] → the first layer's input [T, hidden]."""
        if self.embed_rows is not None:
            h = self.embed_rows(input_ids)
        else:
            h = vocab_parallel_embedding(input_ids, self.embed_tokens, self.tp)
        h = h if self.embed_scale is None else h * self.embed_scale
        return h if self.image_rows is None else self.image_rows.place(h)

    def rope(self, positions: torch.Tensor, meta: AttentionMetadata):
        """(cos, sin) for the step's positions, or (None, None) without RoPE."""
        return (None, None) if self.rotary is None else self.rotary(positions, meta)

    def layer_ropes(self, positions: torch.Tensor, meta: AttentionMetadata) -> list[tuple]:
        """Each layer's (cos, sin) for the step: `rope`'s for every layer, or with `layer_rotary` each table's,
        gathered once per step whatever the number of layers that share it."""
        if self.layer_rotary is None:
            return [self.rope(positions, meta)] * len(self.layers)
        gathered: dict[int, tuple] = {}
        for table in self.layer_rotary:
            if id(table) not in gathered:
                gathered[id(table)] = table(positions, meta)
        return [gathered[id(table)] for table in self.layer_rotary]

    def prepare(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """What every forward starts with: the first layer's input and each layer's (cos, sin); the prompt runs
        of `both_ways_token` are marked in `meta`, so that prefill attention un-masks them both ways."""
        if self.both_ways_token is not None and meta.prefills:
            meta.attend_both_ways(input_ids == self.both_ways_token)
        return self.embed(input_ids, positions), self.layer_ropes(positions, meta)

    def finish(self, h: torch.Tensor) -> torch.Tensor:
        """The last layer's output → final hidden states."""
        return self.norm(h)

    @functools.cached_property
    def cpu_decoder_step(self) -> DecoderStep | None:
        """The fused CPU decode step for this model, built on first use (after quantization), or None (the
        reason in `DecoderStep.why_not`)."""
        if type(self).finish is not CausalLM.finish:
            DecoderStep.why_not = "a model with its own final stage"
            return None
        return DecoderStep.build(self)

    def fused_decode(self, h: torch.Tensor, ropes: list[tuple], kv_cache: KVCache, meta: AttentionMetadata):
        """The final hidden states from the fused CPU decode step (given each layer's (cos, sin)), or None where it
        does not run this step."""
        step = self.cpu_decoder_step
        if step is None or not step.fits(kv_cache, meta):
            return None
        return step(h, ropes, kv_cache, meta, self.lora_rows)  # every layer (and LoRA delta) in one C call

    @torch.inference_mode()
    def greedy_steps(
        self, tokens: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, steps: int, stop_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`steps` greedy decode steps of the sequences of `meta` (the metadata of the window's last step, one
        new token per sequence) in one call, from `tokens` [S], their last tokens: the chosen ids and their
        logprobs [n, S] for the n steps run (fewer when a step chose a `stop_ids` token), the tokens of as many
        forward + `compute_logits` + argmax steps. None where the fused CPU step cannot run them: the caller
        then runs single steps."""
        step = self.cpu_decoder_step
        plain = type(self).embed is CausalLM.embed and type(self).compute_logits is CausalLM.compute_logits
        # Dynamic NTK picks each step's frequencies from its sequence lengths, which the window's metadata lacks.
        dynamic = any(table.rope_type == "dynamic" for table in self.layer_rotary or [self.rotary] if table is not None)
        if step is None or not plain or dynamic or self.embed_scale is not None or not step.fits(kv_cache, meta):
            return None
        positions = (meta.positions.unsqueeze(0) + torch.arange(1 - steps, 1).unsqueeze(1)).reshape(-1)
        return step.greedy(tokens, positions, self.layer_ropes(positions, meta), kv_cache, meta, stop_ids)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions [T] → final hidden states [T, hidden]; writes the step's K/V into `kv_cache`."""
        h, ropes = self.prepare(input_ids, positions, meta)
        fused = self.fused_decode(h, ropes, kv_cache, meta)
        if fused is not None:
            return fused
        with ops.row_kinds(meta.num_tokens, meta.prompt_ranges):  # prompt rows on the prompt GEMM (ops.py)
            for layer, (cos, sin), k_cache, v_cache in zip(self.layers, ropes, kv_cache.k, kv_cache.v, strict=True):
                h = layer(h, cos, sin, k_cache, v_cache, meta)
        return self.finish(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] → logits [N, vocab] in float32 (sampling and logprobs want full precision)."""
        return self.lm_head(hidden).float()


class DecoderLM(CausalLM):
    """A CausalLM whose layers carry the residual stream: `layer(h, residual, cos, sin, ...) → (h, residual)`,
    the last residual add done by the final norm (`add_forward`)."""

    def llama_block(
        self, weights: Weights, prefix: str, norm: NormLoader, mlp: nn.Module, window=None, qk_norms=None
    ) -> PreNormLayer:
        """A layer named like Llama's (`self_attn.{q,k,v,o}_proj`, `input_layernorm`, `post_attention_layernorm`,
        each norm loaded by `norm(name)`) around the family's MLP, with RoPE from `self.rotary`. The attention
        projections read this rank's heads only under tensor parallelism."""
        attn, head_dim = f"{prefix}.self_attn", self.spec.head_dim
        qkv = [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"]
        o_proj = RowParallelLinear.load(weights, f"{attn}.o_proj", query_columns(weights, qkv, head_dim))
        qkv_proj = ColumnParallelLinear.load_qkv(weights, qkv, head_dim)
        attention = Attention(qkv_proj, o_proj, self.spec, self.rotary.rotate_fn, window, qk_norms)
        return PreNormLayer(
            norm(f"{prefix}.input_layernorm"), attention, norm(f"{prefix}.post_attention_layernorm"), mlp
        )

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions [T] → final hidden states [T, hidden]; writes the step's K/V into `kv_cache`."""
        (h, ropes), residual = self.prepare(input_ids, positions, meta), None
        fused = self.fused_decode(h, ropes, kv_cache, meta)
        if fused is not None:
            return fused
        with ops.row_kinds(meta.num_tokens, meta.prompt_ranges):  # prompt rows on the prompt GEMM (ops.py)
            for layer, (cos, sin), k_cache, v_cache in zip(self.layers, ropes, kv_cache.k, kv_cache.v, strict=True):
                h, residual = layer(h, residual, cos, sin, k_cache, v_cache, meta)
        return self.norm.add_forward(h, residual)[0]
