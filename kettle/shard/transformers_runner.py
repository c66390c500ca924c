"""The step skeleton shared by the runners that drive transformers models (causal fallback, seq2seq).

They keep each request's KV in transformers' own cache objects instead of the paged cache; beside the paged runner
(`runner.py`) they implement the same contract (`runner_protocol.Runner`). A subclass computes the last-token
logits of every request of the step (and the prompt logprobs asked for); sampling, stopping, detokenization and
the `Generation` messages are `StepOutputs`', as for the paged runner.

Per-request state is keyed by request id and dropped through `release` (the engine calls it for finished,
filtered and cleared requests). The router's `cache_len` is only trusted as "where this request must be after
this step": a prompt whose prefix the router found in its prefix cache is still computed from our own state,
since transformers' caches cannot share the paged blocks.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from kettle.proto import generate_pb2 as pb
from kettle.shard.batch import RequestState
from kettle.shard.runner_protocol import Capabilities
from kettle.shard.step_outputs import StepOutputs, StepResult, prompt_and_output
from kettle.shard.vocab import Vocab
from kettle.tensors.zeroed_memory import Residency


@dataclass(frozen=True)
class CacheBudget:
    """The router's KV accounting (blocks of tokens) without paged tensors: transformers holds the K/V."""

    num_blocks: int
    block_size: int
    # Nothing to fault in: transformers allocates its own caches as it goes.
    residency: Residency = field(default_factory=lambda: Residency(None))

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError(
                f"a KV budget needs at least one block of one slot, got {self.num_blocks}x{self.block_size}"
            )


@dataclass
class StepLogits:
    """What a subclass's forward returns: last-token logits per ready request id, and prompt logprobs."""

    last: dict[int, torch.Tensor]
    prefill: dict[int, pb.Tokens]


class TransformersRunner:
    """A runner whose forward is a transformers model's; subclasses implement `_logits` and `_drop`."""

    # Transformers' caches: padded batches, one token a step, in the model's dtype; a step cannot be computed
    # ahead, since a dropped one could not be rolled back out of them.
    capabilities = Capabilities(paged=False, speculation=False, overlap=False, kv_dtypes=False, decode_window=False)
    speculate = 0

    def __init__(self, model, vocab: Vocab, device: torch.device, watermark: tuple[float, float]) -> None:
        self.model = model
        self.vocab = vocab
        self.device = device
        self.kv_cache: CacheBudget | None = None
        self.outputs = StepOutputs(vocab, device, watermark, self._history)

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.model.spec.dtype

    def allocate_cache(self, num_blocks: int, block_size: int) -> None:
        """Records the budget the router plans with; transformers allocates K/V as requests grow."""
        self.release(None)
        self.kv_cache = CacheBudget(num_blocks, block_size)

    def release(self, request_ids: Iterable[int] | None) -> None:
        """Drops the cached state of `request_ids` (None: of every request)."""
        self._drop(None if request_ids is None else set(request_ids))

    @torch.inference_mode()
    def step(self, requests: list[RequestState], window: int = 1) -> StepResult:
        """Runs one forward for `requests` (one step whatever the `window`: transformers' caches are stepped by
        its own forward); a request whose prompt is not complete yet produces nothing."""
        start = time.perf_counter_ns()
        ends = [r.cache_len + len(r.next_query()) for r in requests]
        computed = self._logits(requests, ends)
        for request, end in zip(requests, ends, strict=True):
            request.cache_len = end
        ready = [r for r in requests if not r.in_prefill]
        if not ready:
            return StepResult([], set(), time.perf_counter_ns() - start, 0)
        logits = torch.stack([computed.last[r.id] for r in ready]).float()
        sampled = self.outputs.sample(ready, logits)
        forward_ns = time.perf_counter_ns() - start
        result = self.outputs.apply(ready, sampled, computed.prefill)
        result.forward_ns, result.decode_ns = forward_ns, time.perf_counter_ns() - start - forward_ns
        return result

    def _logits(self, requests: list[RequestState], ends: list[int]) -> StepLogits:
        raise NotImplementedError

    def _drop(self, request_ids: set[int] | None) -> None:
        raise NotImplementedError

    def _history(self, requests: list[RequestState]) -> tuple[torch.Tensor, torch.Tensor]:
        """The penalties' token history: the requests' prompt and output (a seq2seq runner overrides it)."""
        return prompt_and_output(requests, self.device)

    def _prompt_logprobs(self, request: RequestState, logits: torch.Tensor) -> pb.Tokens:
        """decoder_input_details from the logits at the prompt's positions but the last: each scores the next."""
        targets = request.all_ids[1 : request.prompt_len]
        logprobs = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
        chosen = logprobs.gather(1, torch.tensor(targets, device=logprobs.device).unsqueeze(1)).squeeze(1)
        request.prompt_logprobs = chosen.tolist()
        return self.outputs.prompt_tokens(request, request.prompt_logprobs)

    def _wants_prompt_logprobs(self, request: RequestState, past: int, end: int) -> bool:
        # Only when the whole prompt is computed in this step (as the paged runner: first chunk only).
        return request.prefill_logprobs and past == 0 and end == request.prompt_len
