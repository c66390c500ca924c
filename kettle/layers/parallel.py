"""Tensor-parallel layers: each rank loads only its slice of a checkpoint's matrices (Megatron-style splits).

- Column-parallel (q/k/v, gate/up, the LM head): a rank holds a block of output rows, so its output is a block
  of features and needs no communication; fused projections are sliced part by part, then concatenated, so
  the rank's fused matrix is [q_r; k_r; v_r], not a slice of [q; k; v].
- Row-parallel (o_proj, down): a rank holds the matching block of input columns and computes a partial sum,
  all-reduced across the ranks; the bias is added by rank 0 only.
- Attention heads go with their KV heads: the KV heads are shared out over the ranks (as evenly as they
  divide, so 9 heads in 3 KV groups run on 2 ranks as 6 + 3), or replicated when there are fewer KV heads than
  ranks (each rank then keeps the one KV head its query heads attend to). Other splits need not be even either.
- Vocab-parallel embedding and LM head: a rank holds a block of vocabulary rows (padded so every block has the
  same size). The embedding looks up its own ids and all-reduces; the LM head all-gathers the logits. The
  alternative, gathering on rank 0 and broadcasting its choice, would save little (the logits of the rows
  sampled, not the whole step) and need every per-token result (ids, logprobs, top-n, stop) broadcast too;
  with all-gather every rank holds the same full logits (collectives leave identical bits on every rank) and
  samples them with the same per-request seeded generators, so the ranks pick the same tokens, keep the same
  stopping state and KV caches in step, and the sampling code is unchanged.

At world size 1 every loader returns the plain `Linear` (read with `Weights.get`, as before), so an unsharded
model is bit-identical and runs no extra code.
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


def scaled(rows: Rows, factor: int) -> Rows:
    return rows[0] * factor, rows[1] * factor


class ColumnParallelLinear:
    """Loaders of column-parallel projections: `Linear`s over this rank's output rows."""

    @staticmethod
    def load(weights: Weights, prefixes: list[str], rows: Sequence[Rows] | None = None) -> Linear:
        """The projections named by `prefixes`, each cut to its rows (default: `split_range`), then fused."""
        tp = weights.tp
        if not tp.sharded:
            return Linear.load(weights, prefixes)
        if rows is None:
            rows = [split_range(weights.shape(f"{p}.weight")[0], tp) for p in prefixes]
        parts = [weights.get_slice(f"{p}.weight", 0, *r) for p, r in zip(prefixes, rows, strict=True)]
        biases = [_optional_slice(weights, f"{p}.bias", 0, r) for p, r in zip(prefixes, rows, strict=True)]
        return Linear(torch.cat(parts) if len(parts) > 1 else parts[0], fuse_biases(biases, parts))

    @staticmethod
    def load_qkv(weights: Weights, prefixes: list[str], head_dim: int) -> Linear:
        """Fused q/k/v over this rank's query heads and its (possibly replicated) KV heads."""
        tp = weights.tp
        if not tp.sharded:
            return Linear.load(weights, prefixes)
        split = _checkpoint_heads(weights, prefixes, head_dim)
        kv_rows = scaled(split.kv, head_dim)
        return ColumnParallelLinear.load(weights, prefixes, [scaled(split.q, head_dim), kv_rows, kv_rows])

    @staticmethod
    def load_fused_qkv(weights: Weights, prefix: str, num_heads: int, num_kv_heads: int, head_dim: int) -> Linear:
        """One checkpoint tensor laid out [q heads | k heads | v heads] (GPT-BigCode's multi-query c_attn), cut
        to this rank's heads of each of the three parts."""
        tp = weights.tp
        if not tp.sharded:
            return Linear.load(weights, [prefix])
        split = head_split(num_heads, num_kv_heads, tp)
        q_rows, kv_rows = scaled(split.q, head_dim), scaled(split.kv, head_dim)
        k_start, v_start = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
        rows = [q_rows, (k_start + kv_rows[0], k_start + kv_rows[1]), (v_start + kv_rows[0], v_start + kv_rows[1])]
        return ColumnParallelLinear.load(weights, [prefix] * 3, rows)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_rᵀ) (+ b on rank 0): the input is this rank's block of features."""

    def __init__(self, linear: Linear, tp: TensorParallel) -> None:
        super().__init__()
        self.linear = linear
        self.tp = tp

    @property
    def out_features(self) -> int:
        return self.linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.linear(x))

    @classmethod
    def load(cls, weights: Weights, prefix: str, cols: Rows | None = None) -> Linear | RowParallelLinear:
        """The projection `prefix` cut to its input columns (default: `split_range`); a plain Linear unsharded."""
        tp = weights.tp
        if not tp.sharded:
            return Linear.load(weights, [prefix])
        name = f"{prefix}.weight"
        cols = cols or split_range(weights.shape(name)[1], tp)
        # Every rank's partial sum would add the bias again: only rank 0 keeps it.
        bias = weights.get_optional(f"{prefix}.bias") if tp.rank == 0 else None
        return cls(Linear(weights.get_slice(name, 1, *cols), bias), tp)


def _optional_slice(weights: Weights, name: str, dim: int, rows: Rows) -> torch.Tensor | None:
    return weights.get_slice(name, dim, *rows) if weights.has(name) else None


def vocab_block(vocab_size: int, tp: TensorParallel) -> int:
    """Rows per rank of a vocab-parallel matrix: the vocabulary rounded up to a multiple of the ranks."""
    return -(-vocab_size // tp.world_size)


def vocab_rows(weights: Weights, name: str) -> torch.Tensor:
    """This rank's block of vocabulary rows of `name`, zero-padded to `vocab_block` rows (the last rank's)."""
    tp = weights.tp
    if not tp.sharded:
        return weights.get(name)
    vocab, hidden = weights.shape(name)
    block = vocab_block(vocab, tp)
    start, stop = min(tp.rank * block, vocab), min((tp.rank + 1) * block, vocab)
    rows = weights.get_slice(name, 0, start, stop)
    if stop - start == block:
        return rows
    padded = torch.zeros(block, hidden, dtype=rows.dtype, device=rows.device)
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

    def __init__(self, weight: torch.Tensor, vocab_size: int, tp: TensorParallel) -> None:
        super().__init__()
        # Named like the model attribute so fp8 quantization, which keeps modules named "lm_head", skips it.
        self.lm_head = Linear(weight)
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
    """The LM head: a plain Linear unsharded, else the gathering vocab-parallel head (which has no bias)."""
    if not tp.sharded:
        return Linear(weight, bias)
    if bias is not None:
        raise ValueError("an LM head with a bias has no tensor-parallel implementation: run with --num-shard 1")
    return VocabParallelHead(weight, vocab_size, tp)


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Embedding rows of `ids` from this rank's vocabulary block; other ranks' ids give zeros, and the sum over
    the ranks (all-reduce) is the full lookup."""
    if not tp.sharded:
        return F.embedding(ids, weight)
    local = ids - tp.rank * weight.shape[0]
    outside = (local < 0) | (local >= weight.shape[0])
    rows = F.embedding(local.masked_fill(outside, 0), weight)
    return tp.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0.0))
