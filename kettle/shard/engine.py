"""The shard's engine: the calls of the shard protocol on proto messages, over the cached batches.

Synchronous and single-threaded by design: the gRPC service runs it in one worker thread, so model state is
never touched concurrently.

A failed call (a request the engine cannot take, a forward, sampling, detokenization or stop matching that
raises) drops every batch it took and releases the runner's state for every request in them: the router fails
those requests and owns their KV blocks, so nothing of theirs may outlive the call here.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import torch

from kettle.process_memory import release_free_memory
from kettle.proto import generate_pb2 as pb
from kettle.shard.batch import Batch, RequestState
from kettle.shard.detokenize import IncrementalDetokenizer
from kettle.shard.lookahead import Lookahead
from kettle.shard.runner import Computed
from kettle.shard.runner_protocol import Runner
from kettle.shard.sampling import SamplingParams
from kettle.shard.speculation import drafter_for
from kettle.shard.step_outputs import StepResult
from kettle.shard.stopping import StoppingCriteria
from kettle.shard.warmup import KVPlan, plan_kv_cache
from kettle.tensors import distributed

logger = logging.getLogger(__name__)


class ShardEngine:
    """Executes Prefill / Decode / FilterBatch / ClearCache / Warmup for one rank."""

    def __init__(
        self,
        runner: Runner,
        kv_memory_fraction: float,
        rank: int = 0,
        world_size: int = 1,
        cuda_memory_fraction: float = 0.9,
        overlap: bool = False,
    ) -> None:
        self.runner = runner
        self.kv_memory_fraction = kv_memory_fraction  # on the CPU: share of the available RAM
        self.cuda_memory_fraction = cuda_memory_fraction  # on CUDA: share of the free GPU memory
        self.rank = rank
        self.world_size = world_size
        self.batches: dict[int, Batch] = {}
        self.adapters: tuple[str, ...] = ()  # the LoRA adapters attached to the model, by index
        # Compute the next decode step while the router handles the last one: only a runner that can drop a step.
        self.overlap = overlap and runner.capabilities.overlap
        self._ahead: Lookahead | None = None

    # --- protocol calls -------------------------------------------------------------------------------

    def prefill(self, request: pb.PrefillRequest) -> pb.PrefillResponse:
        """Computes the prompts of a new batch, together with a cached batch's decodes when given."""
        start = time.perf_counter_ns()
        self._claim_ahead(None)
        cached = [request.cached_batch] if request.HasField("cached_batch") else []
        batch = self._assemble(cached, request.batch)
        result, kept = self._run(batch)
        return pb.PrefillResponse(
            generations=result.generations,
            batch=self._cached(kept),
            forward_ns=result.forward_ns,
            decode_ns=result.decode_ns,
            total_ns=time.perf_counter_ns() - start,
        )

    def decode(self, request: pb.DecodeRequest) -> pb.DecodeResponse:
        """Decode steps over the concatenation of the given cached batches: one, or up to `max_steps` while the
        batch has requests left and none of them waits for a prompt chunk from the router."""
        start = time.perf_counter_ns()
        ahead = self._claim_ahead(request.batches)
        batch = self._assemble(request.batches)
        concat_ns = time.perf_counter_ns() - start
        result, kept = self._run(batch, ahead, request.max_steps)
        merged = {g.request_id: g for g in result.generations}
        forward_ns, decode_ns, steps = result.forward_ns, result.decode_ns, result.steps
        while kept is not None and steps < request.max_steps and not any(r.in_prefill for r in kept.requests):
            batch = self._take(kept.id)
            result, kept = self._run(batch, window=request.max_steps - steps)
            _append_step(merged, result.generations)
            forward_ns, decode_ns = forward_ns + result.forward_ns, decode_ns + result.decode_ns
            steps += result.steps
        return pb.DecodeResponse(
            generations=merged.values(),
            batch=self._cached(kept),
            forward_ns=forward_ns,
            decode_ns=decode_ns,
            total_ns=time.perf_counter_ns() - start,
            concat_ns=concat_ns,
            steps=steps,
        )

    def filter_batch(self, request: pb.FilterBatchRequest) -> pb.FilterBatchResponse:
        """Keeps only the listed requests of a cached batch."""
        self._claim_ahead(None)
        taken = self._take(request.batch_id)
        batch = taken.filter(request.request_ids)
        self.runner.release({r.id for r in taken.requests} - set(request.request_ids))
        if batch is None:
            return pb.FilterBatchResponse()
        self.batches[batch.id] = batch
        return pb.FilterBatchResponse(batch=batch.to_pb(self._block_size))

    def clear_cache(self, request: pb.ClearCacheRequest) -> None:
        """Drops one cached batch, or all of them."""
        self._claim_ahead(None)
        if request.HasField("id"):
            dropped = self.batches.pop(request.id, None)
            self.runner.release([r.id for r in dropped.requests] if dropped is not None else [])
        else:
            self.batches.clear()
            self.runner.release(None)

    def warmup(self, request: pb.WarmupRequest) -> pb.WarmupResponse:
        """Sizes the KV cache from the memory available, then runs a prefill to prove the model runs."""
        self._claim_ahead(None)
        started = time.monotonic()
        spec, device = self.runner.model.spec, self.runner.device
        plan = self._same_on_all_ranks(
            plan_kv_cache(
                spec, device, request, self.kv_memory_fraction, self.cuda_memory_fraction, self.runner.cache_dtype
            )
        )
        # Said before the wait (a large cache, a long prefill on the CPU, CUDA graph captures: it can take minutes).
        logger.info(
            "Warming up: a KV cache of %.1f MiB, then a prefill of up to %d tokens",
            plan.bytes / 2**20,
            plan.warmup_tokens,
        )
        self.runner.allocate_cache(plan.num_blocks, plan.block_size)
        self._warmup_forward(request.batch, plan.block_size, plan.warmup_tokens)
        # The CPU cache's pages fault in from here, behind the answer (kettle/tensors/zeroed_memory.py).
        self.runner.kv_cache.residency.start()
        self.batches.clear()
        self.runner.release(None)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB); warmed up in %.1f s",
            plan.num_blocks,
            plan.block_size,
            plan.num_blocks * plan.block_size,
            plan.bytes / 2**20,
            time.monotonic() - started,
        )
        return pb.WarmupResponse(
            max_supported_total_tokens=plan.num_blocks * plan.block_size,
            max_input_tokens=request.max_input_tokens,
            max_total_tokens=request.max_total_tokens,
            num_blocks=plan.num_blocks,
            block_size=plan.block_size,
        )

    def settle(self) -> None:
        """Hands what the steps freed back to the system, when no batch is cached (the service calls it once the
        shard has been idle a while). glibc keeps freed activations, logits and sampling buffers resident for
        reuse, in holes of its arenas that `free` never returns: over a few bursts of requests a bundled-model
        shard's memory apart from the KV cache grew from 387 to ~465 MiB and stayed there with nothing to serve.
        `malloc_trim` takes 2-5 ms for that much; the pages fault back in on the next steps."""
        if not self.batches:
            release_free_memory()

    def look_ahead(self) -> None:
        """Computes the next decode step of the one cached batch, if there is exactly one (see `lookahead.py`).
        The service calls this after answering each call, so it runs while the answer travels."""
        if self.overlap and self._ahead is None and len(self.batches) == 1:
            self._ahead = Lookahead.start(self.runner, next(iter(self.batches.values())))

    # --- helpers --------------------------------------------------------------------------------------

    @property
    def _block_size(self) -> int:
        assert self.runner.kv_cache is not None
        return self.runner.kv_cache.block_size

    @staticmethod
    def _same_on_all_ranks(plan: KVPlan) -> KVPlan:
        # Ranks see different free memory; with tensor parallelism they must still run the same warmup shapes
        # (their collectives pair up) and report the same capacity, so all take the smallest plan.
        tp = distributed.current()
        if not tp.sharded:
            return plan
        blocks, tokens = tp.min_int(plan.num_blocks), tp.min_int(plan.warmup_tokens)
        return dataclasses.replace(
            plan, num_blocks=blocks, bytes=plan.bytes // plan.num_blocks * blocks, warmup_tokens=tokens
        )

    def _claim_ahead(self, batches: Sequence[pb.CachedBatch] | None) -> Computed | None:
        """The step computed ahead when this call (a Decode of `batches`) is that step; otherwise it is dropped
        before the call touches any state (None: the call is no Decode)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if batches is not None and ahead.matches(batches):
            return ahead.computed
        ahead.drop()
        return None

    def _take(self, batch_id: int) -> Batch:
        batch = self.batches.pop(batch_id, None)
        if batch is None:
            raise KeyError(f"batch {batch_id} not found")
        return batch

    def _assemble(self, cached: Sequence[pb.CachedBatch], new: pb.Batch | None = None) -> Batch:
        """The cached batches taken for this step, then the new one, as one batch (in that order).

        If any part cannot be built, everything already taken is released before the error goes up: a batch
        taken from `self.batches` and never run must not leave the runner's state for its requests behind.
        """
        batches: list[Batch] = []
        try:
            batches += [self._continue(b) for b in cached]
            if new is not None:
                batches.append(Batch(new.id, [self._state(r) for r in new.requests]))
            return Batch.concatenate(batches) if len(batches) > 1 else batches[0]
        except Exception:
            self.runner.release([r.id for b in batches for r in b.requests])
            raise

    def _continue(self, cached: pb.CachedBatch) -> Batch:
        """Takes a cached batch for the next step, with the router's next chunk for requests still in prefill."""
        batch = self._take(cached.id)
        if cached.chunk_lens:
            for request in batch.requests:
                request.chunk_len = cached.chunk_lens.get(request.id, request.chunk_len)
        return batch

    def _run(self, batch: Batch, ahead: Computed | None = None, window: int = 1) -> tuple[StepResult, Batch | None]:
        """One step (or the one computed `ahead` applied, or up to `window` greedy steps where the runner can run
        them at once); the batch is cached again without its finished requests. A failure drops the batch."""
        try:
            with self.runner.kv_cache.residency.working():  # the KV cache's pages fault in between the work
                if ahead is None:
                    result = self.runner.step(batch.requests, window)
                else:
                    result = self.runner.finish(batch.requests, ahead)
        except Exception:
            self.runner.release([r.id for r in batch.requests])
            raise
        self.runner.release(result.finished)
        remaining = [r.id for r in batch.requests if r.id not in result.finished]
        kept = batch.filter(remaining)
        if kept is None:
            return self._local(result), None
        self.batches[kept.id] = kept
        return self._local(result), kept

    def _cached(self, kept: Batch | None) -> pb.CachedBatch | None:
        """The router's view of the batch a call kept (built once per call, not per step)."""
        return None if kept is None else kept.to_pb(self._block_size)

    def _local(self, result: StepResult) -> StepResult:
        # Tensor-parallel ranks compute every request; each reports its share so the router gets one copy.
        if self.world_size > 1:
            result.generations = [g for g in result.generations if g.request_id % self.world_size == self.rank]
        return result

    def _state(self, request: pb.Request) -> RequestState:
        params = SamplingParams.from_proto(request.parameters)
        stopping = request.stopping_parameters
        generator = torch.Generator(device=self.runner.device)
        generator.manual_seed(params.seed)
        prompt = list(request.input_ids)
        return RequestState(
            id=request.id,
            all_ids=prompt.copy(),
            prompt_len=len(prompt),
            cache_len=request.cache_len,
            chunk_len=request.chunk_len,
            blocks=list(request.blocks),
            params=params,
            generator=generator,
            stopping=StoppingCriteria(
                self.runner.vocab.eos_token_ids,
                list(stopping.stop_sequences),
                stopping.max_new_tokens,
                stopping.ignore_eos_token,
            ),
            detokenizer=IncrementalDetokenizer(self.runner.vocab.tokenizer, prompt),
            top_n_tokens=request.top_n_tokens,
            prefill_logprobs=request.prefill_logprobs,
            grammar=self.runner.outputs.grammars.matcher(request.parameters),
            adapter=self._adapter_index(request.adapter_id),
            drafter=drafter_for(params, request, self.runner.speculate),
            images=list(request.images),
        )

    def _adapter_index(self, adapter_id: str) -> int:
        if not adapter_id:
            return -1
        if adapter_id not in self.adapters:  # the router checks first: reaching here is a protocol error
            raise ValueError(f"adapter `{adapter_id}` is not loaded on this shard")
        return self.adapters.index(adapter_id)

    def _warmup_forward(self, batch: pb.Batch, block_size: int, max_tokens: int) -> None:
        """Runs the warmup batch's prompts (capped at `max_tokens`) with blocks assigned here."""
        requests, used, next_block = [], 0, 0
        for request in batch.requests:
            ids = list(request.input_ids)[: max(0, max_tokens - used)]
            if not ids:
                break
            n_blocks = -(-(len(ids) + 1) // block_size)
            warm = pb.Request(id=request.id, input_ids=ids, parameters=request.parameters)
            warm.stopping_parameters.max_new_tokens = 1
            warm.blocks.extend(range(next_block, next_block + n_blocks))
            requests.append(self._state(warm))
            used, next_block = used + len(ids), next_block + n_blocks
        if requests:
            self.runner.step(requests)


def _append_step(merged: dict[int, pb.Generation], generations: Sequence[pb.Generation]) -> None:
    """Adds one more step's generations to those of the call's earlier steps: one Generation per request, its
    tokens and top tokens in order (MergeFrom appends repeated fields), ending with the step that finished it."""
    for generation in generations:
        earlier = merged.get(generation.request_id)
        if earlier is None:
            merged[generation.request_id] = generation
            continue
        drafted, accepted = (
            earlier.draft_tokens + generation.draft_tokens,
            earlier.accepted_tokens + generation.accepted_tokens,
        )
        earlier.MergeFrom(generation)
        earlier.draft_tokens, earlier.accepted_tokens = drafted, accepted
