"""The paged KV cache: one pool of fixed-size blocks per layer, addressed by flat slot index.

A sequence owns a list of blocks (its block table, chosen by the router's allocator); the token at position
`p` of that sequence lives in slot `table[p // block_size] * block_size + p % block_size`. Keeping the pool
flat ([slots, kv_heads, head_dim]) lets one `index_copy_` write the new K/V of every token of a step and one
gather read any set of contexts, whatever the block tables look like.
"""

from __future__ import annotations

import torch

from kettle.tensors.zeroed_memory import Residency, zeroed_tensors

# Tokens per block: small enough that a request wastes little of its last block, large enough that block
# tables stay short. Shared with the router's allocator through the shard's Info response.
BLOCK_SIZE = 16
# TGI's `--kv-cache-dtype fp8_e4m3fn | fp8_e5m2` (CUDA): K/V stored in 8 bits with a scale of 1.0, as TGI and
# vLLM do when a checkpoint brings no calibrated K/V scales; each format's largest finite value, looked up once
# here, is where the cache writes saturate.
FLOAT8_MAX = {dtype: float(torch.finfo(dtype).max) for dtype in (torch.float8_e4m3fn, torch.float8_e5m2)}
FLOAT8 = tuple(FLOAT8_MAX)


def to_cache_dtype(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`rows` in a cache's element type. A float8 cast beyond the format's range gives NaN (e4m3fn) or infinity
    (e5m2), and one such key would poison every later score of its sequence, so values saturate at the largest
    finite one first, as the fp8 caches of TGI and vLLM do."""
    if dtype in FLOAT8:
        limit = FLOAT8_MAX[dtype]
        rows = rows.clamp(-limit, limit)
    return rows.to(dtype)


def write_slots(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache[slots] = rows, cast to the cache's dtype. A float8 cache is written through a byte view: PyTorch's
    `index_copy_` has no float8 kernel."""
    rows = to_cache_dtype(rows, cache.dtype)
    if cache.dtype in FLOAT8:
        cache.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))
    else:
        cache.index_copy_(0, slots, rows)


class KVCache:
    """Key and value tensors of every layer, each [num_blocks * block_size, num_kv_heads, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        fault_in_later: bool = False,
    ) -> None:
        """`fault_in_later`: return before a CPU cache's pages are in (the caller starts `residency` when it
        suits it); otherwise they are in on return, as `torch.zeros` leaves them."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV cache needs at least one block of one slot, got {num_blocks}x{block_size}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        # Zeros rather than empty: padded gathers read unused slots (masked out), and NaN garbage there would
        # survive a -inf mask as NaN * 0 in some kernels. On the CPU the zeros come from the kernel, and with
        # `fault_in_later` the pages fault in when `residency.start()` asks (the shard: after its warm-up prefill).
        if self.device.type == "cpu":
            tensors, self.residency = zeroed_tensors(2 * num_layers, shape, dtype)
            if not fault_in_later:
                self.residency.wait()
        else:
            tensors = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(2 * num_layers)]
            self.residency = Residency(None)
        self.k: list[torch.Tensor] = tensors[:num_layers]
        self.v: list[torch.Tensor] = tensors[num_layers:]

    @property
    def num_slots(self) -> int:
        """Capacity in tokens."""
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Memory the whole cache takes (keys and values of every layer)."""
        return self.num_slots * self.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Memory one cached token takes across all layers (keys and values)."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * element_size

    @classmethod
    def for_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        block_size: int = BLOCK_SIZE,
    ) -> KVCache:
        """The largest cache (in whole blocks) that fits in `budget_bytes`."""
        per_block = cls.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype) * block_size
        num_blocks = budget_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"{budget_bytes} bytes cannot hold one KV block of {per_block} bytes")
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
