"""The facts about a loaded model that the rest of the shard needs (KV cache sizing, Info)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
        from kettle.shard.kv_cache import KVCache

        return KVCache.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)
