"""The facts about a loaded model that the rest of the shard needs (KV cache sizing, Info)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kettle.layers.parallel import head_split
from kettle.tensors.distributed import TensorParallel
from kettle.tensors.kv_cache import KVCache


@dataclass(frozen=True)
class ModelSpec:
    """Shape and type of a loaded causal LM, independent of its architecture."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    sliding_window: int | None  # set when every layer attends within the same window
    dtype: torch.dtype

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache memory one token takes across all layers."""
        return KVCache.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)


def shard_heads(spec: ModelSpec, tp: TensorParallel) -> ModelSpec:
    """The spec as one rank sees it: its own query and KV heads (the KV cache is sized from these)."""
    if not tp.sharded:
        return spec
    split = head_split(spec.num_heads, spec.num_kv_heads, tp)
    return dataclasses.replace(spec, num_heads=split.q[1] - split.q[0], num_kv_heads=split.kv[1] - split.kv[0])
