"""Tensor-parallel layers: each rank loads only its slice of a checkpoint's matrices (Megatron-style splits).

- Column-parallel (q/k/v, gate/up, the LM head): a rank holds a block of output rows, so its output is a block
  of features and needs no communication; fused projections are sliced part by part, then concatenated, so
  the rank's fused matrix is [q_r; k_r; v_r], not a slice of [q; k; v]. Checkpoints that store them fused
  already are cut the same way: stacked parts (`load_stacked`, `load_fused_qkv`), or q/k/v grouped per KV head
  (`grouped_qkv_rows`: Falcon, and the per-head interleave of GPT-NeoX and BLOOM, a group per head), read as
  the block of the rank's KV groups and reordered.
- Row-parallel (o_proj, down): a rank holds the matching block of input columns and computes a partial sum,
  all-reduced across the ranks; the bias is added by rank 0 only. A mixture of experts sums its experts'
  partial outputs (`load_partial`) and all-reduces once.
- Attention heads go with their KV heads: the KV heads are shared out over the ranks (as evenly as they
  divide, so 9 heads in 3 KV groups run on 2 ranks as 6 + 3), or replicated when there are fewer KV heads than
  ranks (each rank then keeps the one KV head its query heads attend to). Other splits need not be even either.
- Vocab-parallel embedding and LM head: a rank holds a block of vocabulary rows (padded so every block has the
  same size), and of the head's bias when it has one. The embedding looks up its own ids and all-reduces; the LM
  head all-gathers the logits. The alternative, gathering on rank 0 and broadcasting its choice, would save
  little (the logits of the rows sampled, not the whole step) and need every per-token result (ids, logprobs,
  top-n, stop) broadcast too; with all-gather every rank holds the same full logits (collectives leave identical
  bits on every rank) and samples them with the same per-request seeded generators, so the ranks pick the same
  tokens, keep the same stopping state and KV caches in step, and the sampling code is unchanged.

At world size 1 every loader returns what `Linear.load` returns (read with `Weights.get`, as before), so an
unsharded model is bit-identical and runs no extra code. Sharded under int8/int4 (`Weights.quantize`), each
rank quantizes the slice it read (`projection`): per-channel scales of a column-parallel slice are the whole
matrix's; a row-parallel slice's scales cover its own columns only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kettle.layers.linear import Linear, fuse_biases
from kettle.tensors.distributed import TensorParallel
from kettle.tensors.weights import Weights

Rows = tuple[int, int]


def split_range(size: int, tp: TensorParallel) -> Rows:
    """This rank's block of `size` items, split as evenly as possible (the first ranks take one more)."""
    base, extra = divmod(size, tp.world_size)
    start = tp.rank * base + min(tp.rank, extra)
    return start, start + base + (tp.rank < extra)


@dataclass(frozen=True)
class HeadSplit:
    """This rank's query heads and key/value heads, as [start, stop) head indices."""

    q: Rows
    kv: Rows


def head_split(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadSplit:
    """Shares the KV heads out over the ranks (unevenly when they do not divide: 3 KV heads over 2 ranks give
    2 and 1), each rank taking the query heads that attend to its KV heads. With fewer KV heads than ranks, each
    KV head is replicated on world/KV ranks, which split its query heads between them."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} attention heads do not group over {num_kv_heads} key/value heads")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp.world_size:
        kv = split_range(num_kv_heads, tp)
        return HeadSplit((kv[0] * group, kv[1] * group), kv)
    sharing = tp.world_size // num_kv_heads  # ranks per replicated KV head
    if tp.world_size % num_kv_heads or group % sharing:
        raise ValueError(
            f"{num_heads} attention heads with {num_kv_heads} key/value heads cannot be split over "
            f"{tp.world_size} shards: choose a --num-shard that divides the heads"
        )
    head, part = divmod(tp.rank, sharing)
    start = head * group + part * (group // sharing)
    return HeadSplit((start, start + group // sharing), (head, head + 1))


def _checkpoint_heads(weights: Weights, qkv_prefixes: list[str], head_dim: int) -> HeadSplit:
    q, k = (weights.shape(f"{p}.weight")[0] // head_dim for p in qkv_prefixes[:2])
    return head_split(q, k, weights.tp)


def query_columns(weights: Weights, qkv_prefixes: list[str], head_dim: int) -> Rows | None:
    """The input columns of the attention output projection that belong to this rank's query heads."""
    if not weights.tp.sharded:
        return None
    return scaled(_checkpoint_heads(weights, qkv_prefixes, head_dim).q, head_dim)


def attention_columns(tp: TensorParallel, num_heads: int, num_kv_heads: int, head_dim: int) -> Rows | None:
    """`query_columns` from the head counts (for checkpoints whose q/k/v is one tensor)."""
    return scaled(head_split(num_heads, num_kv_heads, tp).q, head_dim) if tp.sharded else None


def rank_heads(values: torch.Tensor, num_heads: int, num_kv_heads: int, tp: TensorParallel) -> torch.Tensor:
    """The entries of a per-query-head tensor (ALiBi slopes) that belong to this rank's heads."""
    return values[slice(*head_split(num_heads, num_kv_heads, tp).q)] if tp.sharded else values


def scaled(rows: Rows, factor: int) -> Rows:
    return rows[0] * factor, rows[1] * factor


def projection(weights: Weights, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """A projection over the [out, in] `weight` this rank read: quantized by the load's scheme when there is
    one (as `Linear.load` would have quantized the whole matrix), else a `Linear`."""
    return Linear.from_tensor(weights, weight, bias)


def read_rows(weights: Weights, name: str, rows: Rows | None) -> torch.Tensor:
    """Rows `start:stop` of a tensor (all of it for None), reading only that part of the file."""
    return weights.get(name) if rows is None else weights.get_slice(name, 0, *rows)


class ColumnParallelLinear:
    """Loaders of column-parallel projections: `Linear`s over this rank's output rows."""

    @staticmethod
    def load(weights: Weights, prefixes: list[str], rows: Sequence[Rows] | None = None) -> nn.Module:
        """The projections named by `prefixes`, each cut to its rows (default: `split_range`), then fused."""
        tp = weights.tp
        if not tp.sharded:
            return Linear.load(weights, prefixes)
        if rows is None:
            rows = [split_range(weights.shape(f"{p}.weight")[0], tp) for p in prefixes]
        parts = [weights.get_slice(f"{p}.weight", 0, *r) for p, r in zip(prefixes, rows, strict=True)]
        biases = [_optional_slice(weights, f"{p}.bias", 0, r) for p, r in zip(prefixes, rows, strict=True)]
        return projection(weights, torch.cat(parts) if len(parts) > 1 else parts[0], fuse_biases(biases, parts))

    @staticmethod
    def load_stacked(weights: Weights, prefix: str, parts: int) -> nn.Module:
        """One checkpoint tensor that is `parts` equal projections stacked (Phi-3's gate_up_proj [gate; up]),
        cut to this rank's rows of each part."""
        tp = weights.tp
        if not tp.sharded:
            return Linear.load(weights, [prefix])
        size = weights.shape(f"{prefix}.weight")[0] // parts
        start, stop = split_range(size, tp)
        rows = [(i * size + start, i * size + stop) for i in range(parts)]
        return ColumnParallelLinear.load(weights, [prefix] * parts, rows)

    @staticmethod
    def load_qkv(weights: Weights, prefixes: list[str], head_dim: int) -> nn.Module:
        """Fused q/k/v over this rank's query heads and its (possibly replicated) KV heads."""
        tp = weights.tp
        if not tp.sharded:
            return Linear.load(weights, prefixes)
        split = _checkpoint_heads(weights, prefixes, head_dim)
        kv_rows = scaled(split.kv, head_dim)
        return ColumnParallelLinear.load(weights, prefixes, [scaled(split.q, head_dim), kv_rows, kv_rows])

    @staticmethod
    def load_fused_qkv(weights: Weights, prefix: str, num_heads: int, num_kv_heads: int, head_dim: int) -> nn.Module:
        """One checkpoint tensor laid out [q heads | k heads | v heads] (GPT-BigCode's multi-query c_attn,
        Phi-3's qkv_proj, MPT's Wqkv, Falcon 7B's query_key_value), cut to this rank's heads of each part."""
        tp = weights.tp
        if not tp.sharded:
            return Linear.load(weights, [prefix])
        split = head_split(num_heads, num_kv_heads, tp)
        q_rows, kv_rows = scaled(split.q, head_dim), scaled(split.kv, head_dim)
        k_start, v_start = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
        rows = [q_rows, (k_start + kv_rows[0], k_start + kv_rows[1]), (v_start + kv_rows[0], v_start + kv_rows[1])]
        return ColumnParallelLinear.load(weights, [prefix] * 3, rows)


def grouped_qkv_rows(num_heads: int, num_kv_heads: int, head_dim: int, tp: TensorParallel) -> tuple[Rows, torch.Tensor]:
    """Where this rank's q, k and v rows lie in a fused qkv stored grouped per KV head, [kv, G q heads + k + v,
    head_dim] rows (Falcon 40B; with G = 1 it is the per-head [q | k | v] interleave, with one KV head the plain
    [q heads | k | v]): (the block of rows spanning the rank's KV groups, the row indices into that block that
    give [q heads | k heads | v heads]). Unsharded: every group, in the fused layout's order."""
    split = head_split(num_heads, num_kv_heads, tp)
    group = num_heads // num_kv_heads
    width = (group + 2) * head_dim  # rows per KV group
    first, last = split.kv
    dims = torch.arange(head_dim)
    q = [(h // group - first) * width + (h % group) * head_dim + dims for h in range(*split.q)]
    k = [(g - first) * width + group * head_dim + dims for g in range(first, last)]
    v = [(g - first) * width + (group + 1) * head_dim + dims for g in range(first, last)]
    return scaled(split.kv, width), torch.cat(q + k + v)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_rᵀ) (+ b on rank 0): the input is this rank's block of features."""

    def __init__(self, linear: nn.Module, tp: TensorParallel) -> None:
        super().__init__()
        self.linear = linear
        self.tp = tp

    @property
    def out_features(self) -> int:
        return self.linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.linear(x))

    @classmethod
    def load(cls, weights: Weights, prefix: str, cols: Rows | None = None) -> nn.Module:
        """The projection `prefix` cut to its input columns (default: `split_range`); a plain Linear unsharded."""
        partial = cls.load_partial(weights, prefix, cols)
        return cls(partial, weights.tp) if weights.tp.sharded else partial

    @staticmethod
    def load_partial(weights: Weights, prefix: str, cols: Rows | None = None) -> nn.Module:
        """This rank's term of the sum, not yet reduced: for a caller that adds several row-parallel outputs
        before one all-reduce (the experts of a mixture). The whole projection unsharded."""
        tp = weights.tp
        if not tp.sharded:
            return Linear.load(weights, [prefix])
        name = f"{prefix}.weight"
        cols = cols or split_range(weights.shape(name)[1], tp)
        # Every rank's partial sum would add the bias again: only rank 0 keeps it.
        bias = weights.get_optional(f"{prefix}.bias") if tp.rank == 0 else None
        return projection(weights, weights.get_slice(name, 1, *cols), bias)


def _optional_slice(weights: Weights, name: str, dim: int, rows: Rows) -> torch.Tensor | None:
    return weights.get_slice(name, dim, *rows) if weights.has(name) else None


def vocab_block(vocab_size: int, tp: TensorParallel) -> int:
    """Rows per rank of a vocab-parallel matrix: the vocabulary rounded up to a multiple of the ranks."""
    return -(-vocab_size // tp.world_size)


def vocab_rows(weights: Weights, name: str) -> torch.Tensor:
    """This rank's block of vocabulary rows of `name` (a matrix, or an LM head's bias), zero-padded to
    `vocab_block` rows (the last rank's)."""
    tp = weights.tp
    if not tp.sharded:
        return weights.get(name)
    vocab, *rest = weights.shape(name)
    block = vocab_block(vocab, tp)
    start, stop = min(tp.rank * block, vocab), min((tp.rank + 1) * block, vocab)
    rows = weights.get_slice(name, 0, start, stop)
    if stop - start == block:
        return rows
    padded = torch.zeros(block, *rest, dtype=rows.dtype, device=rows.device)
    padded[: stop - start] = rows
    return padded


def load_vocab_parallel(
    weights: Weights, embed_name: str, head_name: str, tied: bool
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(embedding rows, LM head rows, full vocabulary size); the head is the embedding tensor itself when tied
    or absent from the checkpoint, as `Weights.output_embedding` decides unsharded."""
    embed = vocab_rows(weights, embed_name)
    if not weights.tp.sharded:
        head = weights.output_embedding(embed, head_name, tied)
        return embed, head, int(head.shape[0])
    shared = tied or not weights.has(head_name)
    head = embed if shared else vocab_rows(weights, head_name)
    return embed, head, weights.shape(embed_name if shared else head_name)[0]


class VocabParallelHead(nn.Module):
    """The LM head over this rank's vocabulary block; logits of all ranks are all-gathered, so every rank
    returns the full [N, vocab] logits (and samples the same token as every other rank)."""

    def __init__(
        self, weight: torch.Tensor, vocab_size: int, tp: TensorParallel, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        # Named like the model attribute so fp8 quantization, which keeps modules named "lm_head", skips it.
        self.lm_head = Linear(weight, bias)
        self.out_features = vocab_size
        self.tp = tp

    @property
    def layout(self) -> str:
        return self.lm_head.layout

    @property
    def dense_weight(self) -> torch.Tensor:
        return self.lm_head.dense_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(self.lm_head(x))[..., : self.out_features]


def vocab_parallel_head(
    weight: torch.Tensor, vocab_size: int, tp: TensorParallel, bias: torch.Tensor | None = None
) -> Linear | VocabParallelHead:
    """The LM head: a plain Linear unsharded, else the gathering vocab-parallel head (`bias`, when the head has
    one, is this rank's block of it: `vocab_rows`)."""
    if not tp.sharded:
        return Linear(weight, bias)
    return VocabParallelHead(weight, vocab_size, tp, bias)


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Embedding rows of `ids` from this rank's vocabulary block; other ranks' ids give zeros, and the sum over
    the ranks (all-reduce) is the full lookup."""
    if not tp.sharded:
        return F.embedding(ids, weight)
    local = ids - tp.rank * weight.shape[0]
    outside = (local < 0) | (local >= weight.shape[0])
    rows = F.embedding(local.masked_fill(outside, 0), weight)
    return tp.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0.0))
