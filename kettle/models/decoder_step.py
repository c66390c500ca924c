"""A decoder's whole decode step in one call into Kettle's CPU kernels (kettle/kernels/decoder_step.c).

`DecoderStep.build(model)` describes a loaded `CausalLM` to the C step once, from each layer's `plan()`
(kettle/models/decoder.py `BlockPlan`: norms, attention, MLP, residual shape) and the model's rotary
embeddings (one table, or with `layer_rotary` one per distinct RoPE setting, each layer naming its own);
`step(embedded, ropes, kv_cache, meta)` then runs every layer of a decode-only step from each layer's (cos, sin)
(`CausalLM.layer_ropes`, each table gathered once) and returns the final norm's output, as the model's own
forward would, but without ~10 Python-level ops and OpenMP fork/joins per layer (the measurement is in
decoder_step.c).

What the C step has kernels for: RMSNorm and LayerNorm (with or without bias); sequential and parallel
residuals; branch-output norms (Gemma 2); RoPE over the whole head or a leading part, halves or interleaved
pairs, or none (learned positions), each layer from its own table (Gemma 3's local and global bases); per-head
q/k norms; score soft-capping; sliding windows; gated or plain MLPs (SiLU, tanh-GELU, erf-GELU, ReLU) and top-k
mixtures of gated experts. That covers Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3, Phi, Phi-3,
StarCoder2, GPT-NeoX, GPT-J, Falcon (RoPE layouts), Mixtral, GPT-2, GPT-BigCode. Not described: ALiBi (BLOOM,
MPT, Falcon-ALiBi), qkv clipping, post-norm blocks, OPT's final projection.

It applies to a CPU float32 model whose every projection is a `Q4Linear`, a `Q8Linear` (GGUF Q8_0), a
`Q6Linear` (GGUF Q6_K), a kernel-backed `Int8Linear` or a float32 `Linear` stored dense
(`KETTLE_TUNING=cpu-linear=dense`: the default oneDNN-packed layout has no rows to read), on one shard, with
quantized activations on, a KV cache of float32, float16 or bfloat16 (`--kv-cache-dtype`) and a decode batch the
packed kernels take (`dense_rows`). Anything else
returns None from `build` (with the reason in `DecoderStep.why_not`) or False from `fits`, and the model's
forward runs layer by layer. `KETTLE_TUNING=decoder-step=off` turns it off.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from kettle import settings
from kettle.kernels import ops
from kettle.kernels.decoder_step import (
    ACT_GELU,
    ACT_GELU_TANH,
    ACT_RELU,
    ACT_SILU,
    MAX_EXPERTS,
    NORM_LAYER,
    NORM_NONE,
    NORM_RMS,
    Decoder,
    Experts,
    Layer,
    Lora,
    Norm,
    StepRows,
    run,
    run_greedy,
)
from kettle.kernels.structs import LINEAR_F32, LINEAR_Q5L, LINEAR_Q6L, LINEAR_Q8, LINEAR_Q8G, LINEAR_Q8L, Linear
from kettle.layers import linear as dense
from kettle.layers.activation import activation
from kettle.layers.attention import AttentionMetadata
from kettle.layers.lora import LoraLinear, LoraRows
from kettle.layers.norm import LayerNorm, RMSNorm
from kettle.layers.rotary import RotaryEmbedding
from kettle.models.blocks import DenseMLP, GatedMLP
from kettle.models.decoder import Attention, BlockPlan
from kettle.quantization.int8 import Int8Linear
from kettle.quantization.iq4 import IQ4Linear
from kettle.quantization.kernel_weight import StackedWeight
from kettle.quantization.q4 import Q4Linear
from kettle.quantization.q5 import Q5Linear
from kettle.quantization.q6 import Q6Linear
from kettle.quantization.q8 import Q8Linear
from kettle.tensors.kv_cache import KVCache


class Unsupported(Exception):
    """A part of the model the C step has no kernel for (the message says which)."""


def enabled() -> bool:
    """False when `KETTLE_TUNING=decoder-step=off`."""
    return settings.current().cpu_decoder_step


def _ptr_of(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _linear(module: nn.Module) -> Linear:
    """The C description of a projection (unwrapping row-parallel and LoRA wrappers)."""
    while hasattr(module, "linear"):  # row-parallel and LoRA wrappers hold the projection itself
        module = module.linear
    bias = _ptr_of(getattr(module, "bias", None))
    if isinstance(module, Q4Linear | Q5Linear | Q6Linear | Q8Linear | IQ4Linear | StackedWeight):
        return module.describe()
    if isinstance(module, Int8Linear) and module.cpu_kernel and module.in_features % 32 == 0:
        return module.describe()
    if isinstance(module, dense.Linear) and module.layout == "dense" and _float32_rows(module.weight):
        n, k = module.weight.shape
        return Linear(LINEAR_F32, k, n, k, module.weight.data_ptr(), None, None, bias)
    if isinstance(module, dense.Linear) and module.layout != "dense":
        # oneDNN's packed layout is the faster one for the layer-by-layer matmuls of a float32 model.
        raise Unsupported(f"float32 weights in the {module.layout} layout (KETTLE_TUNING=cpu-linear=dense: rows)")
    raise Unsupported(f"a {type(module).__name__} projection (it reads int4, int8 or dense float32 rows)")


def _embedding_and_head(model: nn.Module) -> tuple[Linear, Linear] | None:
    """The C descriptions of the input embedding (float32 rows, or a quantized table's) and of the LM head, for
    the greedy steps; None unless the head is GGUF's Q8_0 (`Q8Linear`, a GGUF checkpoint's), Q6_K (`Q6Linear`) or
    Q5_K (`Q5Linear`) or a kernel-backed int8 one (`Int8Linear`, `--quantize int4|int8`'s), which the C loop runs
    as `compute_logits` does."""
    head = getattr(model, "lm_head", None)
    try:
        heads = (LINEAR_Q8G, LINEAR_Q8L, LINEAR_Q8, LINEAR_Q6L, LINEAR_Q5L)
        if not isinstance(head, Q8Linear | Q6Linear | Q5Linear | Int8Linear) or _linear(head).kind not in heads:
            return None
    except Unsupported:
        return None
    embed_rows = getattr(model, "embed_rows", None)
    weight = getattr(model, "embed_tokens", None)
    if embed_rows is not None:
        table = getattr(embed_rows, "__self__", None)  # the table's bound `embed` (a tied head's, or its own)
        try:
            kinds = Q8Linear | Q4Linear | Q5Linear | Q6Linear | IQ4Linear | Int8Linear
            embedding = _linear(table) if isinstance(table, kinds) else None
        except Unsupported:  # an int8 table the kernels do not read (a row width not a multiple of 32)
            return None
    elif weight is not None and weight.dim() == 2 and _float32_rows(weight):
        n, k = weight.shape
        embedding = Linear(LINEAR_F32, k, n, k, weight.data_ptr(), None, None, None)
    else:
        return None
    # The loop embeds the token it chose: every column of a padded head must be a row of the table (the single
    # step's embedding would refuse an id past it; the C loop would read outside it).
    ends = (embedding, _linear(head))
    return ends if embedding is not None and ends[1].n <= embedding.n else None


def _float32_rows(weight: torch.Tensor) -> bool:
    """A float32 [out, in] CPU weight the C tiles read in place (rows of a multiple of 8 floats)."""
    return (
        weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.is_contiguous()
        and weight.shape[1] % 8 == 0
    )


def _norm(norm: nn.Module | None) -> Norm:
    """The C description of a norm (NORM_NONE for None)."""
    if norm is None:
        return Norm(NORM_NONE, None, None, 0.0)
    if isinstance(norm, RMSNorm | LayerNorm) and norm.weight.dtype == torch.float32:
        kind = NORM_RMS if isinstance(norm, RMSNorm) else NORM_LAYER
        return Norm(kind, norm.weight.data_ptr(), _ptr_of(getattr(norm, "bias", None)), norm.eps)
    raise Unsupported(f"a {type(norm).__name__}")


# The activations the C step has, by the function a block's MLP applies.
ACTIVATIONS = {
    activation("silu"): ACT_SILU,
    activation("gelu_pytorch_tanh"): ACT_GELU_TANH,
    activation("gelu"): ACT_GELU,
    activation("relu"): ACT_RELU,
}


def _activation(mlp: nn.Module) -> int:
    act = ACTIVATIONS.get(getattr(mlp, "act", None))
    if act is None:
        raise Unsupported(f"the activation {getattr(mlp, 'act', None)!r}")
    return act


class DecoderStep:
    """A model's decode step in one C call; holds the C description of its layers (and so needs the model
    to stay where it was loaded: its tensors are read through raw pointers)."""

    why_not: str | None = None  # set on the class by the last `build` that returned None (for the log)

    def __init__(self, model: nn.Module) -> None:
        spec, rotary = model.spec, model.rotary
        self._keep: list = []  # ctypes arrays the description points into
        self.inner: int | None = None
        self._rotate = None if rotary is None else (RotaryEmbedding.apply, rotary.apply_halves, rotary.rotate)
        indices = self._rope_tables(model)
        layers = [self._layer(layer, index) for layer, index in zip(model.layers, indices, strict=True)]
        self._layers = (Layer * len(layers))(*layers)
        shape = (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, self.inner)
        tables = len(self._firsts)
        rope = (0, 0, 0) if rotary is None else (rotary.rotary_dim, int(rotary.interleaved), tables)
        # block_size (0 here), the cache's type and the tuning are set at each step.
        self.decoder = Decoder(*shape, 0, *rope, self._layers, _norm(model.norm))
        quantized = (m for m in model.modules() if isinstance(m, Q4Linear | Int8Linear))
        self.max_rows = min((getattr(m, "dense_rows", 1 << 62) for m in quantized), default=1 << 62)
        self._caches: tuple[KVCache, ctypes.Array, ctypes.Array] | None = None
        # Each layer's projections in the order of the C step's LoRA entries (LORA_PER_LAYER of them): qkv, o,
        # gate_up, down, each a LoraLinear or the plain projection.
        self._projections = [
            (layer.attn.qkv, layer.attn.o_proj, getattr(layer.mlp, "gate_up", None), getattr(layer.mlp, "down", None))
            for layer in model.layers
        ]
        self._loras: dict[tuple[int, ...], tuple[ctypes.Array, list]] = {}
        self._ends = _embedding_and_head(model)  # for `greedy`: (embedding, LM head) or None

    @classmethod
    def build(cls, model: nn.Module) -> DecoderStep | None:
        """The step for `model`, or None when it does not apply (the reason in `DecoderStep.why_not`)."""
        try:
            cls._check_model(model)
            return cls(model)
        except Unsupported as reason:
            DecoderStep.why_not = str(reason)
            return None

    @staticmethod
    def _check_model(model: nn.Module) -> None:
        if not enabled():
            raise Unsupported("KETTLE_TUNING=decoder-step=off")
        if not (ops.available() and ops.quantized_activations()):
            raise Unsupported("the CPU kernels (or their quantized activations) are off")
        if model.tp.sharded:
            raise Unsupported("tensor parallelism")
        norm = getattr(model, "norm", None)
        if model.spec.dtype != torch.float32 or norm is None or norm.weight.device.type != "cpu":
            raise Unsupported("a model that is not float32 on the CPU")

    def _rope_tables(self, model: nn.Module) -> list[int]:
        """Each layer's RoPE table as an index into the step's tables (numbered by first use), and in `_firsts` each
        table's first layer, whose (cos, sin) the step passes for the table. No RoPE: no tables."""
        rotary = model.rotary
        per_layer = getattr(model, "layer_rotary", None) or [rotary] * len(model.layers)
        numbers: dict[int, int] = {}
        self._firsts: list[int] = []
        for i, table in enumerate(per_layer if rotary is not None else []):
            # One rot_dim and layout for every table (`CausalLM.load_rotary` holds them to it): the C step has one.
            if (table.rotary_dim, table.interleaved) != (rotary.rotary_dim, rotary.interleaved):
                raise Unsupported("RoPE tables that rotate different parts of the head")
            if id(table) not in numbers:
                numbers[id(table)] = len(self._firsts)
                self._firsts.append(i)
        return [numbers.get(id(table), 0) for table in per_layer]

    def _angles(self, ropes: list[tuple]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The step's cos and sin [tables, rows, rot_dim] from each layer's (cos, sin): each table's once."""
        if not self._firsts:
            return None, None
        rot = self.decoder.rot_dim
        if len(self._firsts) == 1:  # every model but Gemma 3: the step's one table as it is, a view (no copy)
            cos, sin = ropes[self._firsts[0]]
            return cos.reshape(1, -1, rot), sin.reshape(1, -1, rot)
        cos = torch.stack([ropes[i][0].reshape(-1, rot) for i in self._firsts])
        sin = torch.stack([ropes[i][1].reshape(-1, rot) for i in self._firsts])
        return cos, sin

    def _layer(self, layer: nn.Module, rope_table: int) -> Layer:
        """The C description of one block, rotating with the step's table `rope_table`."""
        plan: BlockPlan | None = layer.plan() if hasattr(layer, "plan") else None
        if plan is None or not isinstance(plan.attn, Attention):
            raise Unsupported(f"a {type(layer).__name__} block")
        attn = plan.attn
        if attn.alibi_slopes is not None or attn.clip is not None:
            raise Unsupported("ALiBi" if attn.alibi_slopes is not None else "qkv clipping")
        if (attn.rotate is None) != (self._rotate is None) or (attn.rotate and attn.rotate not in self._rotate):
            raise Unsupported("a rotary embedding other than the model's")
        norms = [_norm(n) for n in (plan.input_norm, plan.mlp_norm, plan.attn_out_norm, plan.mlp_out_norm)]
        norms += [_norm(attn.q_norm), _norm(attn.k_norm)]
        projections = [_linear(attn.qkv), _linear(attn.o_proj)]
        gated, act, up, down, experts = self._mlp(plan.mlp)
        self._keep += [*projections, up, down]  # a stacked projection's parts, which the copies below point to
        options = (attn.sliding_window or 0, int(plan.parallel), gated, act, rope_table)
        return Layer(*norms, *projections, up, down, *options, attn.scale, attn.softcap or 0.0, experts)

    def _mlp(self, mlp: nn.Module) -> tuple:
        """(gated, activation, up, down, experts or None) of a block's MLP."""
        if isinstance(mlp, GatedMLP):
            self._inner(mlp.gate_up, 2)
            return 1, _activation(mlp), _linear(mlp.gate_up), _linear(mlp.down), None
        if isinstance(mlp, DenseMLP):
            self._inner(mlp.fc, 1)
            return 0, _activation(mlp), _linear(mlp.fc), _linear(mlp.proj), None
        if hasattr(mlp, "router_rows") and len(mlp.experts) <= MAX_EXPERTS:
            return self._experts(mlp)
        raise Unsupported(f"a {type(mlp).__name__} MLP")

    def _experts(self, moe: nn.Module) -> tuple:
        first = moe.experts[0]
        if not all(isinstance(e, GatedMLP) and e.act is first.act for e in moe.experts):
            raise Unsupported("experts that are not alike gated MLPs")
        self._inner(first.gate_up, 2)
        up = (Linear * len(moe.experts))(*(_linear(e.gate_up) for e in moe.experts))
        down = (Linear * len(moe.experts))(*(_linear(e.down) for e in moe.experts))
        experts = Experts(len(moe.experts), moe.top_k, moe.router_rows.data_ptr(), up, down)
        self._keep += [up, down, experts]
        zero = Linear(0, 0, 0, 0, None, None, None, None)
        return 1, _activation(first), zero, zero, ctypes.pointer(experts)

    def _inner(self, up: nn.Module, parts: int) -> None:
        """Every block's MLP must have the same inner width (the step's scratch is sized once)."""
        inner = _linear(up).n // parts
        if self.inner not in (None, inner):
            raise Unsupported("MLPs of different widths")
        self.inner = inner

    def fits(self, kv_cache: KVCache, meta: AttentionMetadata) -> bool:
        """Whether this step can run `meta` over `kv_cache`: decodes only, a CPU cache of float32, float16 or
        bfloat16 (read with float32 math, written rounded to nearest-even), few enough rows."""
        return (
            meta.decode_only
            and meta.num_tokens <= self.max_rows
            and kv_cache.dtype in ops.KV_DTYPES
            and kv_cache.device.type == "cpu"
        )

    def __call__(
        self,
        embedded: torch.Tensor,
        ropes: list[tuple],
        kv_cache: KVCache,
        meta: AttentionMetadata,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        """embedded [S, hidden] float32 → the final norm's output [S, hidden]; writes the step's K/V. `ropes`: each
        layer's (cos, sin) for the step (`CausalLM.layer_ropes`; (None, None) without RoPE). With `lora` active,
        each row also gets its adapter's deltas on the projections the adapters touch."""
        self._per_step(meta.block_size, kv_cache)
        plan = meta.decode
        rows = StepRows(*self._angles(ropes), meta.slots, plan.block_ids, plan.num_blocks, meta.positions)
        loras, slot = (self._lora_array(lora.present), lora.slot) if lora is not None and lora.active else (None, None)
        return run(self.decoder, self._cache_pointers(kv_cache), embedded, rows, loras, slot)

    def greedy(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        ropes: list[tuple],
        kv_cache: KVCache,
        meta: AttentionMetadata,
        stop_ids: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Greedy decode steps from `tokens` [S] (each sequence's last token) in one C call, for `positions`
        [steps · S] (step s at s·S .. s·S + S) and each layer's (cos, sin) of them (`CausalLM.layer_ropes`); `meta`
        is the window's last step (its block tables cover every step). Returns the chosen ids and logprobs [n, S] of
        the n steps run (fewer when one chose a `stop_ids` token), or None where the embedding or the head has no C
        description."""
        if self._ends is None:
            return None
        seqs, plan, block = tokens.shape[0], meta.decode, meta.block_size
        self._per_step(block, kv_cache)
        grid = positions.view(-1, seqs)
        tables = plan.block_ids.view(seqs, plan.num_blocks)
        slots = (tables[torch.arange(seqs), grid // block] * block + grid % block).reshape(-1)
        cos, sin = self._angles(ropes)  # [tables, steps · S, rot_dim] → [steps, tables, S, rot_dim]: a step's tables
        if cos is not None:  # side by side, as a single step passes them
            cos, sin = (t.view(t.shape[0], -1, seqs, t.shape[-1]).transpose(0, 1) for t in (cos, sin))
        rows = StepRows(cos, sin, slots, plan.block_ids, plan.num_blocks, positions)
        caches = self._cache_pointers(kv_cache)
        return run_greedy(self.decoder, caches, self._ends, tokens, rows, stop_ids)

    def _per_step(self, block_size: int, kv_cache: KVCache) -> None:
        """What the description takes from each step: the cache's block size and element type, and the path chooser's
        tuning (batch invariance among it; read here so that a test's switch holds)."""
        self.decoder.block_size, self.decoder.kv_dtype = block_size, ops.KV_DTYPES[kv_cache.dtype]
        self.decoder.tuning = ops.tuning()

    def _lora_array(self, present: tuple[int, ...]) -> ctypes.Array:
        """The C description of every projection's stacked LoRA matrices for the adapters `present`, built once
        per set of adapters (a mix usually lasts many steps) and kept with the tensors it points into."""
        if present not in self._loras:
            if len(self._loras) >= 8:
                self._loras.pop(next(iter(self._loras)))
            keep, entries = [], []
            for projection in (p for layer in self._projections for p in layer):
                stack = projection.stack_for(present) if isinstance(projection, LoraLinear) else None
                if stack is None:
                    entries.append(Lora(0, None, None, None, None, None))
                    continue
                widths = stack.columns[:, 1].contiguous()
                columns = stack.columns[:, 0].contiguous()
                keep += [stack, widths, columns]
                pointers = (stack.a, stack.b, stack.mask, columns, widths)
                entries.append(Lora(stack.a.shape[0], *(t.data_ptr() for t in pointers)))
            self._loras[present] = ((Lora * len(entries))(*entries), keep)
        return self._loras[present][0]

    def _cache_pointers(self, kv_cache: KVCache) -> tuple[ctypes.Array, ctypes.Array]:
        """The per-layer cache pointers, rebuilt only when the cache object changes (it is kept alive here)."""
        if self._caches is None or self._caches[0] is not kv_cache:
            pointers = ctypes.c_void_p * kv_cache.num_layers
            k = pointers(*(t.data_ptr() for t in kv_cache.k))
            v = pointers(*(t.data_ptr() for t in kv_cache.v))
            self._caches = (kv_cache, k, v)
        return self._caches[1], self._caches[2]
