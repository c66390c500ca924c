"""KV cache sizing at warmup: how many blocks the cache gets on this device.

On the CPU the cache takes a configurable share of the RAM available at start-up (`--cpu-kv-cache-fraction`);
on CUDA a share of the GPU memory still free once the model is loaded (`--cuda-memory-fraction`, default 0.9:
the rest is left to activations, the warmup prefill and the decode graphs). Both are capped at
`DEFAULT_MAX_KV_TOKENS` tokens, or `KETTLE_TUNING=max-kv-tokens=N`, so a tiny model does not reserve gigabytes.
The warmup forward itself is capped on the CPU (`DEFAULT_CPU_WARMUP_TOKENS`): there it proves the model runs; it
measures nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from kettle import settings
from kettle.proto import generate_pb2 as pb
from kettle.tensors.kv_cache import BLOCK_SIZE, KVCache

DEFAULT_MAX_KV_TOKENS = 1 << 17
# Enough rows for the paths a prompt's layers take (the panel GEMMs from 16 rows, a whole 16-token tile of the
# prefill attention); a longer one proves nothing more and costs start-up time that grows with the model: 512
# tokens took 5.9 s of a 1.1B model's 16 s start here (0.5 s on the bundled model), 64 tokens 0.9 s of a 1.7B
# Q4_K_M file's 3.7 s start. In one process that file's prefill of 24 tokens takes 0.18-0.19 s, of 16 0.13 s
# (an 8B's ~4.5 times as long); a shard's warm-up took 0.3-0.5 s for 24.
DEFAULT_CPU_WARMUP_TOKENS = 16


@dataclass(frozen=True)
class KVPlan:
    """The KV cache the shard allocates, and how many tokens the warmup forward runs."""

    num_blocks: int
    block_size: int
    bytes: int
    warmup_tokens: int


def plan_kv_cache(
    spec,
    device: torch.device,
    request: pb.WarmupRequest,
    cpu_fraction: float,
    cuda_fraction: float = 0.9,
    kv_dtype: torch.dtype | None = None,
) -> KVPlan:
    """Chooses the number of KV blocks from the memory the cache may use on `device`: `cuda_fraction` of the
    free GPU memory on CUDA, `cpu_fraction` of the available RAM elsewhere. Tokens are counted in the cache's
    `kv_dtype` (default: the model's), so a 16-bit cache under a float32 model holds twice the tokens."""
    per_token = KVCache.bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, kv_dtype or spec.dtype)
    fraction = cuda_fraction if device.type == "cuda" else cpu_fraction
    budget = int(_available_bytes(device) * fraction)
    cap = settings.current().max_kv_tokens or DEFAULT_MAX_KV_TOKENS  # read at each plan: a test may change it
    tokens = min(budget // per_token, cap)
    if tokens < request.max_total_tokens:
        raise MemoryError(
            f"the KV cache can hold {tokens} tokens but one request may need {request.max_total_tokens}: "
            "give the cache more memory or lower --max-total-tokens"
        )
    num_blocks = tokens // BLOCK_SIZE
    warmup = request.max_prefill_tokens
    if device.type == "cpu":
        warmup = min(warmup, DEFAULT_CPU_WARMUP_TOKENS)
    return KVPlan(num_blocks, BLOCK_SIZE, num_blocks * BLOCK_SIZE * per_token, min(warmup, tokens - BLOCK_SIZE))


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return psutil.virtual_memory().available
