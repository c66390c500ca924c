"""A scripted stand-in for the shards, so the scheduler and `Infer` run with no model and no gRPC.

Request r emits token ids 1, 2, 3, ... (text "t1", "t2", ...) and finishes at its max_new_tokens. Batches are
kept like the real shards keep them (prefill creates one, decode concatenates into the first id, filter keeps
some ids, clear drops one), and every prefill checks that no live request was given a KV slot another one writes.
Prompts are computed like the real shard computes them: `cache_len` on, `chunk_len` tokens per forward (the
router updates it through `CachedBatch.chunk_lens`), and a request yields its first token only in the forward
that completes its prompt. `forwards` records, per forward, the prompt tokens each prefilling request
computed and the requests that decoded.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

from kettle.proto import generate_pb2 as pb
from kettle.router.client import Timings
from kettle.router.queue import Entry
from kettle.router.types import SamplingParameters, StoppingParameters, ValidGenerateRequest


def make_request(input_len: int = 4, max_new: int = 4, details: bool = False) -> ValidGenerateRequest:
    """A validated request of `input_len` prompt tokens (ids 100, 101, ...)."""
    return ValidGenerateRequest(
        inputs="x" * input_len,
        input_ids=tuple(range(100, 100 + input_len)),
        truncate=None,
        decoder_input_details=details,
        top_n_tokens=0,
        parameters=SamplingParameters(temperature=0.5, top_k=7, seed=42, do_sample=True),
        stopping=StoppingParameters(max_new_tokens=max_new, stop_sequences=("END",)),
    )


def make_entry(entry_id: int, input_len: int = 4, max_new: int = 4, details: bool = False) -> Entry:
    return Entry(entry_id, make_request(input_len, max_new, details))


class FakeClient:
    """Shard calls answered from a script; `calls` records them, `fail_next` makes the next call of a kind raise."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.batches: dict[int, list[int]] = {}  # batch id -> request ids, in order
        self.requests: dict[int, pb.Request] = {}
        self.generated: dict[int, int] = {}
        self.prefilled: dict[int, int] = {}  # request id -> prompt tokens in the (fake) KV cache
        self.chunk_len: dict[int, int] = {}
        self.forwards: list[tuple[dict[int, int], list[int]]] = []  # ({id: prompt tokens}, [decoded ids])
        self.fail_next: dict[str, str] = {}  # method -> error message, used once
        self.healthy = True
        self.steps: list[int] = []  # decode steps each decode call ran

    async def _enter(self, method: str, *args) -> None:
        await asyncio.sleep(0)  # like a real RPC, let other tasks run
        self.calls.append((method, *args))
        if method in self.fail_next:
            raise RuntimeError(self.fail_next.pop(method))

    async def health(self) -> None:
        await self._enter("health")
        if not self.healthy:
            raise RuntimeError("shard down")

    async def prefill(self, batch: pb.Batch, cached_batch: pb.CachedBatch | None = None):
        await self._enter("prefill", batch.id, [r.id for r in batch.requests])
        self._check_blocks(batch.requests)
        for request in batch.requests:
            self.requests[request.id] = request
            self.generated[request.id] = 0
            self.prefilled[request.id] = request.cache_len
            self.chunk_len[request.id] = request.chunk_len
        ids = [r.id for r in batch.requests]
        if cached_batch is not None:
            ids = self._continue(cached_batch) + ids
        return self._forward(ids), self._keep(batch.id if cached_batch is None else cached_batch.id, ids), None

    async def decode(self, batches: Sequence[pb.CachedBatch], max_steps: int = 1):
        """Up to `max_steps` forwards, as the shard runs them: each request's tokens of all of them in one
        Generation, stopping early when no request is left or one is still in prefill."""
        await self._enter("decode", [b.id for b in batches])
        ids = [i for b in batches for i in self._continue(b)]
        merged = {g.request_id: g for g in self._forward(ids)}
        kept, steps = self._keep(batches[0].id, ids), 1
        while kept is not None and steps < max_steps and all(self._prompt_done(i) for i in kept.request_ids):
            ids = self._continue(kept)
            for generation in self._forward(ids):
                merged.setdefault(generation.request_id, pb.Generation()).MergeFrom(generation)
            kept, steps = self._keep(kept.id, ids), steps + 1
        self.steps.append(steps)
        return list(merged.values()), kept, Timings(steps=steps)

    def _prompt_done(self, request_id: int) -> bool:
        return self.prefilled[request_id] == len(self.requests[request_id].input_ids)

    def _continue(self, cached: pb.CachedBatch) -> list[int]:
        """Takes a cached batch, applying the router's next chunks."""
        ids = self.batches.pop(cached.id)
        for request_id, chunk in cached.chunk_lens.items():
            assert request_id in ids, "a chunk for a request not in the batch"
            self.chunk_len[request_id] = chunk
        return ids

    def _forward(self, ids: list[int]) -> list[pb.Generation]:
        """One forward: requests in prefill compute their chunk, the others one token; only complete prompts
        yield a token."""
        computed, decoded, generations = {}, [], []
        for i in ids:
            prompt = len(self.requests[i].input_ids)
            if self.prefilled[i] < prompt:
                chunk = self.chunk_len[i] or prompt - self.prefilled[i]
                computed[i] = min(chunk, prompt - self.prefilled[i])
                self.prefilled[i] += computed[i]
                if self.prefilled[i] == prompt:
                    generations.append(self._next_token(i, first=True))
            else:
                decoded.append(i)
                generations.append(self._next_token(i))
        self.forwards.append((computed, decoded))
        return generations

    async def filter_batch(self, batch_id: int, request_ids: Sequence[int]) -> pb.CachedBatch | None:
        await self._enter("filter", batch_id, list(request_ids))
        return self._keep(batch_id, [i for i in self.batches.pop(batch_id) if i in request_ids])

    async def clear_cache(self, batch_id: int | None = None) -> None:
        await self._enter("clear", batch_id)
        if batch_id is None:
            self.batches.clear()
        self.batches.pop(batch_id, None)

    def method_calls(self, method: str) -> list[tuple]:
        return [c[1:] for c in self.calls if c[0] == method]

    def _next_token(self, request_id: int, first: bool = False) -> pb.Generation:
        n = self.generated[request_id] = self.generated[request_id] + 1
        request = self.requests[request_id]
        tokens = pb.Tokens(ids=[n], logprobs=[-0.5], texts=[f"t{n}"], is_special=[False])
        generation = pb.Generation(request_id=request_id, tokens=tokens)
        if first and request.prefill_logprobs:
            logprobs = [math.nan] + [-1.0] * (len(request.input_ids) - 1)
            texts = [f"p{i}" for i in request.input_ids]
            generation.prefill_tokens.CopyFrom(pb.Tokens(ids=request.input_ids, logprobs=logprobs, texts=texts))
        if n >= request.stopping_parameters.max_new_tokens:
            text = "".join(f"t{i}" for i in range(1, n + 1))
            generation.generated_text.CopyFrom(pb.GeneratedText(text=text, generated_tokens=n, finish_reason=0))
        return generation

    def _keep(self, batch_id: int, ids: list[int]) -> pb.CachedBatch | None:
        alive = [i for i in ids if self.generated[i] < self.requests[i].stopping_parameters.max_new_tokens]
        if not alive:
            return None
        self.batches[batch_id] = alive
        return pb.CachedBatch(id=batch_id, request_ids=alive, size=len(alive))

    def _check_blocks(self, requests: Sequence[pb.Request]) -> None:
        """No slot a new request writes (from its cache_len on) is used by any other live or new request.

        A shared prefix (slots before cache_len) may be read by many; a slot someone writes must be its own.
        """
        live = [self.requests[i] for ids in self.batches.values() for i in ids]
        for request in requests:
            written = set(request.slots[request.cache_len :])
            others = [s for r in live + list(requests) if r is not request for s in r.slots]
            assert not written & set(others), "a KV block was given to two live requests"
