"""The paged runner: one forward step of Kettle's own models over the paged KV cache, for a list of requests.

Build tensors → forward → choose tokens (`StepOutputs` samples, stops and detokenizes, as for every runner).
Prefill chunks and decodes share one flat token layout, so a step may mix them (chunked prefill) and a
prompt may start after a cached prefix (prefix caching): both only change `cache_len` / `chunk_len`.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kettle import settings
from kettle.kernels import ops
from kettle.layers.attention import AttentionMetadata, long_tensor
from kettle.proto import generate_pb2 as pb
from kettle.quantization.loading import in_lanes
from kettle.shard.batch import RequestState
from kettle.shard.cuda_graphs import DecodeGraphs, graphs_enabled
from kettle.shard.greedy_window import window_steps
from kettle.shard.logits_process import device_tensor
from kettle.shard.runner_protocol import Capabilities
from kettle.shard.sampling import SampleOutput
from kettle.shard.speculation import accepted_tokens, drafts_for, step_rows, verify_drafts
from kettle.shard.step_outputs import StepOutputs, StepResult
from kettle.shard.vocab import Vocab
from kettle.tensors.kv_cache import KVCache


@dataclass
class Computed:
    """A step's forward and token choice, not yet applied to its requests (`PagedRunner.finish` does that)."""

    query_lens: list[int]  # tokens each request feeds to the forward, its draft not counted
    ready: list[int]  # indices of the requests sampled one token
    sampled: SampleOutput | None  # their choice (None: nobody was sampled)
    prefill_logprobs: dict[int, pb.Tokens]
    forward_ns: int
    drafts: list[list[int]]  # each request's draft tokens (speculative decoding; mostly empty)
    verified: torch.Tensor | None = None  # `speculation.verify_drafts` of the requests with a draft


class PagedRunner:
    """Runs steps of Kettle's own models over the paged KV cache for the shard's engine (`runner_protocol.Runner`)."""

    capabilities = Capabilities(paged=True, speculation=True, overlap=True, kv_dtypes=True, decode_window=True)

    def __init__(
        self,
        model,
        vocab: Vocab,
        device: torch.device,
        watermark: tuple[float, float],
        graph_buckets: tuple[int, ...] | None = None,
    ) -> None:
        self.model = model
        self.graph_buckets = graph_buckets  # decode CUDA graph sizes; None: KETTLE_CUDA_GRAPHS decides
        self.vocab = vocab
        self.device = device
        self.kv_cache: KVCache | None = None
        self.outputs = StepOutputs(vocab, device, watermark)
        self.speculate = 0  # draft tokens per step and request (--speculate); 0: off
        self.lanes = in_lanes(model)  # its kernels' passes take 8 rows: a verifying step's limit (speculation.py)
        self.kv_dtype: torch.dtype | None = None  # the paged KV cache's (--kv-cache-dtype); None: the model's
        # A vision-language model's images (`image_inputs.ImageInputs`, set by the server); None: text only.
        self.images = None

    def release(self, request_ids: Iterable[int] | None) -> None:
        """Forgets per-request state kept between steps (None: all): none here, the K/V lives in the router's
        blocks."""

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's element type: `kv_dtype`, else the model's dtype."""
        return self.kv_dtype or self.model.spec.dtype

    def allocate_cache(self, num_blocks: int, block_size: int) -> None:
        """(Re)creates the KV cache with `num_blocks` blocks."""
        spec = self.model.spec
        self.graphs: DecodeGraphs | None = None  # graphs point into the old cache
        self.kv_cache = None  # free the old one before allocating the new one
        # With decode graphs, one block beyond the router's: padded graph rows write their K/V there.
        extra = 1 if graphs_enabled(self.device, self.graph_buckets) else 0
        self.kv_cache = KVCache(
            spec.num_layers,
            num_blocks + extra,
            block_size,
            spec.num_kv_heads,
            spec.head_dim,
            self.cache_dtype,
            self.device,
            fault_in_later=True,  # the warm-up starts it after its prefill (kettle/tensors/zeroed_memory.py)
        )
        if extra:
            self.graphs = DecodeGraphs.for_runner(self.model, self.kv_cache, num_blocks, self.graph_buckets)

    def step(self, requests: list[RequestState], window: int = 1) -> StepResult:
        """Runs one forward for `requests` and returns their generations; with `window` > 1, up to that many
        decode steps in one call where the batch allows it (`greedy_window.py`): where no request has a draft worth
        verifying (computed once here, for the window's choice and the step's forward)."""
        drafts = self._drafts(requests)
        if window > 1 and not any(drafts) and settings.current().greedy_window:
            result = self._greedy_window(requests, window)
            if result is not None:
                return result
        return self.finish(requests, self.compute(requests, drafts))

    def _drafts(self, requests: list[RequestState]) -> list[list[int]]:
        """Each request's draft for its next step (`speculation.drafts_for`); all empty without `--speculate`."""
        if not self.speculate:
            return [[] for _ in requests]
        return drafts_for(requests, self.speculate, step_rows(self.device, self.lanes))

    @torch.inference_mode()
    def _greedy_window(self, requests: list[RequestState], window: int) -> StepResult | None:
        """Up to `window` greedy steps in one call into the model (`CausalLM.greedy_steps`), their tokens
        applied as single steps apply theirs; None where the batch or the model cannot run them."""
        assert self.kv_cache is not None, "Warmup must run before the first forward"
        block_size = self.kv_cache.block_size
        steps = window_steps(requests, window, block_size)
        greedy = getattr(self.model, "greedy_steps", None)
        if steps < 2 or greedy is None:
            return None
        start = time.perf_counter_ns()
        last = [r.cache_len + steps - 1 for r in requests]  # the window's last step: its tables cover all
        meta = AttentionMetadata.build([1] * len(requests), last, [r.blocks for r in requests], block_size, self.device)
        images = self.images if self.images is not None and any(r.images for r in requests) else None
        if images is not None:
            images.window(requests)  # an M-RoPE model's decode offsets (Qwen2-VL's)
        try:
            chosen = greedy(long_tensor(r.all_ids[-1] for r in requests), self.kv_cache, meta, steps, self._stop_ids)
        finally:
            if images is not None:
                images.clear()
        if chosen is None:
            return None
        forward_ns = time.perf_counter_ns() - start
        result = StepResult([], set(), forward_ns, 0, steps=chosen[0].shape[0])
        for request, ids, logprobs in zip(requests, chosen[0].T.tolist(), chosen[1].T.tolist(), strict=True):
            request.cache_len += len(ids)
            generation = self.outputs.advance(request, ids, logprobs, [])
            if generation.HasField("generated_text"):
                result.finished.add(request.id)
            result.generations.append(generation)
        result.decode_ns = time.perf_counter_ns() - start - forward_ns
        return result

    @functools.cached_property
    def _stop_ids(self) -> torch.Tensor:
        """The EOS ids that end a greedy window (int64)."""
        return long_tensor(sorted(self.vocab.eos_token_ids))

    @torch.inference_mode()
    def compute(self, requests: list[RequestState], drafts: list[list[int]] | None = None) -> Computed:
        """The device half of a step: forward and token choice (`drafts`: the requests' drafts when the caller
        has them). It leaves the state of requests past their prompt as it was (only the KV cache rows it writes
        and the sampling generators move), so a step computed ahead of the router's call can still be dropped
        (see `lookahead.py`)."""
        start = time.perf_counter_ns()
        drafts = self._drafts(requests) if drafts is None else drafts
        queries = [r.next_query() + d for r, d in zip(requests, drafts, strict=True)]
        meta, hidden = self._forward(requests, queries, drafts)
        prefill_logprobs = self._prefill_logprobs(requests, queries, meta, hidden)
        # Sampled: every request whose prompt is complete once this step's tokens are in the cache.
        ready = [
            i for i, (r, q) in enumerate(zip(requests, queries, strict=True)) if r.cache_len + len(q) >= r.prompt_len
        ]
        plain, sampled, verified = self._choose(requests, drafts, ready, meta, hidden)
        forward_ns = time.perf_counter_ns() - start
        query_lens = [len(q) - len(d) for q, d in zip(queries, drafts, strict=True)]
        return Computed(query_lens, plain, sampled, prefill_logprobs, forward_ns, drafts, verified)

    def _choose(
        self, requests, drafts, ready, meta, hidden
    ) -> tuple[list[int], SampleOutput | None, torch.Tensor | None]:
        """The token choice of the `ready` requests: the ones without a draft are sampled one token (their
        indices and `SampleOutput`), the others have their drafts verified (`speculation.verify_drafts`)."""
        drafting = [i for i in ready if drafts[i]]
        plain = [i for i in ready if not drafts[i]] if drafting else ready
        # The layout has one sequence per request, and one more per draft token (see `_layout`).
        seq_ends = list(itertools.accumulate(len(d) + 1 for d in drafts))
        sampled = verified = None
        if plain:
            logits = self._last_logits(hidden, meta, [seq_ends[i] - 1 for i in plain])
            sampled = self.outputs.sample([requests[i] for i in plain], logits)
        if drafting:
            seqs = [j for i in drafting for j in range(seq_ends[i] - len(drafts[i]) - 1, seq_ends[i])]
            chosen = [requests[i] for i in drafting]
            verified = verify_drafts(chosen, [drafts[i] for i in drafting], self._last_logits(hidden, meta, seqs))
        return plain, sampled, verified

    @torch.inference_mode()
    def finish(self, requests: list[RequestState], computed: Computed) -> StepResult:
        """The host half of a step: the computed tokens enter the requests (stopping, detokenization)."""
        for request, n in zip(requests, computed.query_lens, strict=True):
            request.cache_len += n
        start = time.perf_counter_ns()
        result = StepResult([], set(), computed.forward_ns, 0)
        if computed.sampled is not None:
            ready = [requests[i] for i in computed.ready]
            result = self.outputs.apply(ready, computed.sampled, computed.prefill_logprobs)
        if computed.verified is not None:
            self._update_drafts(requests, computed, result)
        result.forward_ns, result.decode_ns = computed.forward_ns, time.perf_counter_ns() - start
        return result

    def _forward(
        self, requests: list[RequestState], queries: list[list[int]], drafts: list[list[int]]
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        if self.images is None or not any(r.images for r in requests):
            return self._forward_tokens(requests, queries, drafts)
        # The step's image rows, which the model's embedding puts in place, and an M-RoPE model's positions of
        # every token (Qwen2-VL's), which a decode graph captured with plain positions cannot take.
        per_token_rope = self.images.place(requests, queries)
        try:
            return self._forward_tokens(requests, queries, drafts, graphs=not per_token_rope)
        finally:
            self.images.clear()  # a forward that failed before embedding must not leave rows behind

    def _forward_tokens(
        self, requests: list[RequestState], queries: list[list[int]], drafts: list[list[int]], graphs: bool = True
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        assert self.kv_cache is not None, "Warmup must run before the first forward"
        # Under batch invariance a prompt's tokens are prefills however few a chunk brings (ops.batch_invariant).
        prompts = _prompts(requests, drafts) if self.device.type == "cpu" and ops.batch_invariant() else None
        block_size = self.kv_cache.block_size
        chained = any(drafts)  # a drafting request's rows read each other's new K/V (`_layout`)
        meta = AttentionMetadata.build(*_layout(requests, queries, drafts), block_size, self.device, prompts, chained)
        input_ids = device_tensor(list(itertools.chain.from_iterable(queries)), torch.long, self.device)
        lora = self.model.lora_rows
        if lora is not None:  # each token row runs with its request's adapter
            with_adapter = any(r.adapter >= 0 for r in requests)  # else no per-token list to build
            lora.set(
                [r.adapter for r, q in zip(requests, queries, strict=True) for _ in q] if with_adapter else [],
                self.device,
            )
            if lora.active:  # graphs were captured without the adapters' deltas
                return meta, self.model.forward(input_ids, meta.positions, self.kv_cache, meta)
        replayed = self.graphs.run(input_ids, meta) if self.graphs is not None and graphs else None
        if replayed is not None:
            return meta, replayed.hidden
        return meta, self.model.forward(input_ids, meta.positions, self.kv_cache, meta)

    def _last_logits(self, hidden: torch.Tensor, meta: AttentionMetadata, seqs: list[int]) -> torch.Tensor:
        """The logits at the last token of the given sequences of the step's layout (ascending, no repeats)."""
        rows = meta.last_token_indices
        if len(seqs) < rows.shape[0]:
            rows = rows.index_select(0, device_tensor(seqs, torch.long, rows.device))
        return self.model.compute_logits(hidden[rows])

    def _prefill_logprobs(self, requests, queries, meta, hidden) -> dict[int, pb.Tokens]:
        """Logprobs of the prompt tokens for the requests that asked (decoder_input_details).

        Gathered chunk by chunk (chunked prefill): a chunk's rows score the prompt tokens that follow them, and
        the whole list goes out with the step that computes the prompt's last token.
        """
        out: dict[int, pb.Tokens] = {}
        offsets = itertools.accumulate([len(q) for q in queries], initial=0)
        for request, query, offset in zip(requests, queries, offsets, strict=False):
            start = request.cache_len
            # A prefix read from the cache was never scored here: such a request reports no prompt logprobs.
            if not (request.prefill_logprobs and request.in_prefill and len(request.prompt_logprobs) == start):
                continue
            targets = request.all_ids[start + 1 : start + len(query) + 1]  # all_ids is the prompt during prefill
            request.prompt_logprobs += self._chosen_logprobs(hidden[offset : offset + len(targets)], targets)
            if start + len(query) == request.prompt_len:
                out[request.id] = self.outputs.prompt_tokens(request, request.prompt_logprobs)
        return out

    def _chosen_logprobs(self, hidden: torch.Tensor, targets: list[int]) -> list[float]:
        if not targets:
            return []
        logprobs = torch.log_softmax(self.model.compute_logits(hidden), dim=-1)
        return logprobs.gather(1, torch.tensor(targets, device=logprobs.device).unsqueeze(1)).squeeze(1).tolist()

    def _update_drafts(self, requests: list[RequestState], computed: Computed, result: StepResult) -> None:
        """Applies the verified drafts: each request takes its accepted drafts and the model's token, and its
        cache length moves over the accepted drafts only (the K/V of rejected ones is overwritten later)."""
        assert computed.verified is not None
        host, offset = computed.verified.tolist(), 0
        for request, draft in zip(requests, computed.drafts, strict=True):
            if not draft:
                continue
            tokens, logprobs = accepted_tokens(draft, host[offset : offset + 3 + len(draft)])
            offset += 3 + len(draft)
            # Recorded here, with the step applied, not when drafted: a step computed ahead may be dropped.
            request.drafter.record(len(request.all_ids), len(draft), len(tokens) - 1)
            request.cache_len += len(tokens) - 1
            generation = self.outputs.advance(request, tokens, logprobs, [])
            generation.draft_tokens, generation.accepted_tokens = len(draft), len(tokens) - 1
            if generation.HasField("generated_text"):
                result.finished.add(request.id)
            result.generations.append(generation)


def _prompts(requests: list[RequestState], drafts: list[list[int]]) -> list[bool]:
    """For each sequence of `_layout`, whether it brings prompt tokens (a request that drafts is past its prompt)."""
    return [request.in_prefill for request, draft in zip(requests, drafts, strict=True) for _ in range(len(draft) + 1)]


def _layout(
    requests: list[RequestState], queries: list[list[int]], drafts: list[list[int]]
) -> tuple[list[int], list[int], list[list[int]]]:
    """Query lengths, cache lengths and block tables of the step's sequences: one per request, except that a
    request with a draft is one decode sequence per token it feeds, over its blocks (see `speculation.py`)."""
    if not any(drafts):
        return [len(q) for q in queries], [r.cache_len for r in requests], [r.blocks for r in requests]
    query_lens, cache_lens, tables = [], [], []
    for request, query, draft in zip(requests, queries, drafts, strict=True):
        rows = len(query) if draft else 1
        query_lens += [1] * rows if draft else [len(query)]
        cache_lens += range(request.cache_len, request.cache_len + rows)
        tables += [request.blocks] * rows
    return query_lens, cache_lens, tables
