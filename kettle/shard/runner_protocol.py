"""The contract between the shard's engine and a runner: allocate the cache, run a step, release requests.

Two runners implement it side by side: the paged runner (`runner.py`, Kettle's own models over the paged KV cache)
and the transformers runners (`transformers_runner.py`: the causal fallback and encoder-decoders over transformers'
own caches). What differs between them is said once, in `Capabilities`, which the server and the engine read
instead of comparing execution-path names.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from kettle.shard.batch import RequestState
from kettle.shard.step_outputs import StepOutputs, StepResult
from kettle.shard.vocab import Vocab


@dataclass(frozen=True)
class Capabilities:
    """What a runner can do."""

    # K/V live in the router's blocks: a prefix the router found cached is read, not recomputed, and batches need
    # no padding (`/info`'s requires_padding is the opposite).
    paged: bool
    speculation: bool  # verifies n-gram drafts (`--speculate`)
    # Computes a step ahead (`compute` now, `finish` once the router has answered the last one): overlap
    # scheduling. Only where a dropped step leaves no state behind.
    overlap: bool
    kv_dtypes: bool  # its cache takes `--kv-cache-dtype` (else the model's dtype)
    decode_window: bool  # several greedy decode steps in one call (`greedy_window.py`)


@runtime_checkable
class Runner(Protocol):
    """What the engine calls; `outputs` samples, stops and builds the step's answers for both kinds."""

    capabilities: Capabilities
    model: Any
    vocab: Vocab
    device: torch.device
    outputs: StepOutputs
    speculate: int  # draft tokens per step and request; 0 unless `capabilities.speculation`
    kv_cache: Any  # the cache the last `allocate_cache` made (None before it)

    @property
    def cache_dtype(self) -> torch.dtype: ...

    def allocate_cache(self, num_blocks: int, block_size: int) -> None: ...

    def step(self, requests: list[RequestState], window: int = 1) -> StepResult: ...

    def release(self, request_ids: Iterable[int] | None) -> None: ...
