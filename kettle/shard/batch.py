"""The shard's batch state between calls: per-request state, filter and concatenate.

The router owns scheduling; the shard only remembers, per cached batch, what it needs to run the next step:
each request's tokens, how many of them are in the KV cache, its blocks, its sampler state, its stopping
criteria and its detokenizer. Tensors are built per step from this state in one go (see `runner.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kettle.proto import generate_pb2 as pb
from kettle.shard.detokenize import IncrementalDetokenizer
from kettle.shard.sampling import SamplingParams
from kettle.shard.stopping import StoppingCriteria


@dataclass
class RequestState:
    """One request on the shard: its tokens, KV progress and per-request decoding state."""

    id: int
    all_ids: list[int]  # prompt + generated tokens
    prompt_len: int
    cache_len: int  # tokens whose K/V are already in the cache
    chunk_len: int  # prompt tokens to compute in the next prefill call (0 = all remaining)
    blocks: list[int]
    params: SamplingParams
    generator: torch.Generator
    stopping: StoppingCriteria
    detokenizer: IncrementalDetokenizer
    top_n_tokens: int
    prefill_logprobs: bool
    # Logprobs of prompt tokens 1.. computed so far (decoder_input_details), gathered chunk by chunk.
    prompt_logprobs: list[float] = field(default_factory=list)
    # The request's grammar matcher (llguidance.LLMatcher), advanced with each sampled token; None: no grammar.
    grammar: Any = None
    adapter: int = -1  # index of its LoRA adapter in the shard's --lora-adapters; -1: the base model
    # Its n-gram drafter (`ngram.NgramDrafter`) when it speculates (--speculate); None: one token per step.
    drafter: Any = None
    # The prompt's images (pb.Image: bytes and token run), and the encoded rows of those a chunk has reached and
    # not yet placed entirely, by index (`image_inputs.py`).
    images: Sequence[pb.Image] = ()
    image_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    # An M-RoPE model's (Qwen2-VL's) rotary positions of the prompt [3, prompt_len] and the offset of the tokens
    # after it, computed with its first step (`image_inputs.py`); None: not yet, or a model without them.
    rope: tuple[torch.Tensor, int] | None = None

    @property
    def in_prefill(self) -> bool:
        """True while some prompt tokens still have to be computed."""
        return self.cache_len < self.prompt_len

    def next_query(self) -> list[int]:
        """The tokens this request feeds to the next forward."""
        if not self.in_prefill:
            return self.all_ids[-1:]
        end = self.prompt_len if self.chunk_len == 0 else min(self.prompt_len, self.cache_len + self.chunk_len)
        return self.all_ids[self.cache_len : end]

    @property
    def seed(self) -> int | None:
        """The seed to report: only sampled requests have one."""
        return self.params.seed if self.params.do_sample else None


class Batch:
    """A cached batch: the requests that continue together, in a stable order."""

    def __init__(self, batch_id: int, requests: list[RequestState]) -> None:
        self.id = batch_id
        self.requests = requests

    def __len__(self) -> int:
        return len(self.requests)

    def filter(self, request_ids: Sequence[int]) -> Batch | None:
        """Keeps only `request_ids` (order preserved); None when nothing is left."""
        keep = set(request_ids)
        requests = [r for r in self.requests if r.id in keep]
        return Batch(self.id, requests) if requests else None

    @staticmethod
    def concatenate(batches: Sequence[Batch]) -> Batch:
        """Merges cached batches into one, keeping the first batch's id."""
        requests = [r for b in batches for r in b.requests]
        return Batch(batches[0].id, requests)

    def to_pb(self, block_size: int) -> pb.CachedBatch:
        """The router's view of this batch."""
        max_tokens = sum(len(r.blocks) for r in self.requests) * block_size
        return pb.CachedBatch(
            id=self.id,
            request_ids=[r.id for r in self.requests],
            size=len(self.requests),
            max_tokens=max_tokens,
            current_tokens=sum(len(r.all_ids) for r in self.requests),
        )
