"""CUDA graphs for decode steps: the whole decode forward captured once per batch-size bucket, then replayed.

A decode step of a 7B model is ~500 small kernels; launched from Python one by one, the launch gaps cost as
much as the weight reads at batch 1. A graph replays all of them with one launch. Graphs need fixed shapes
and fixed addresses, so each bucket (`--cuda-graphs`, default 1 to 256) reads its inputs from
static buffers sized for the largest bucket and the longest context: token ids, positions, cache slots and
block tables. The CUDA attention backend reads each sequence's length from those positions, so one graph
serves every context up to `max_context`.

A step with `n` decodes replays the smallest bucket ≥ n; rows n..bucket are padding that write their K/V
into a scratch block the router never hands out (the cache gets one extra block for it) and attend only to
it. Anything else (prefills, mixed steps, speculation's chained rows, larger batches, longer contexts) runs
eagerly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from kettle import settings
from kettle.layers.attention import AttentionMetadata, DecodePlan, get_backend
from kettle.progress import progress_bar
from kettle.shard.config import parse_graph_buckets
from kettle.tensors import distributed
from kettle.tensors.kv_cache import KVCache

logger = logging.getLogger(__name__)

# Past TGI's 1-32: a server under load decodes a hundred sequences or more a step, and eagerly a 7B step then
# pays ~500 launches from Python. Buckets grow by halves of a power of two above 16, so a batch pads by at
# most a third; the largest graph's activations are a few MB (hidden 4,096 × 256 rows), so the pool stays small.
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def graph_buckets(value: str | None = None) -> tuple[int, ...]:
    """Batch sizes to capture, from `value` or KETTLE_CUDA_GRAPHS ("1,2,4"; "0" or "" disables)."""
    value = settings.current().cuda_graphs if value is None else value
    return DEFAULT_BUCKETS if value is None else parse_graph_buckets(value)


def graphs_enabled(device: torch.device, buckets: tuple[int, ...] | None = None) -> bool:
    """Whether decode graphs apply: a CUDA device, buckets configured (`buckets`, else KETTLE_CUDA_GRAPHS),
    and a graph-safe attention backend."""
    buckets = graph_buckets() if buckets is None else buckets
    return device.type == "cuda" and bool(buckets) and get_backend(device_type="cuda").name == "cuda"


@dataclass
class GraphOutput:
    """One replay's results, views into the graph's own memory: valid until the next replay."""

    hidden: torch.Tensor  # [n, hidden]
    logits: torch.Tensor | None  # [n, vocab] float32, when captured with logits


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor
    logits: torch.Tensor | None


class DecodeGraphs:
    """Decode forwards (optionally + logits) captured per batch bucket over one KV cache."""

    def __init__(
        self,
        model,
        kv_cache: KVCache,
        scratch_block: int,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        max_context: int | None = None,
        with_logits: bool = False,
    ) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.block_size = kv_cache.block_size
        self.scratch_block, self.scratch_slot = scratch_block, scratch_block * kv_cache.block_size
        self.buckets = tuple(sorted(buckets))
        limit = min(model.spec.max_position_embeddings, scratch_block * kv_cache.block_size)
        self.max_context = min(max_context or limit, limit)
        self.width = -(-self.max_context // self.block_size)
        self.with_logits = with_logits
        size, device = self.buckets[-1], kv_cache.device
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slots = torch.full((size,), self.scratch_slot, dtype=torch.long, device=device)
        self.tables = torch.full((size, self.width), scratch_block, dtype=torch.long, device=device)
        self.key_positions = torch.arange(self.width * self.block_size, device=device).view(1, 1, 1, -1)
        self._graphs: dict[int, _Captured] = {}
        self._capture()

    @classmethod
    def for_runner(
        cls, model, kv_cache: KVCache, scratch_block: int, buckets: tuple[int, ...] | None = None
    ) -> DecodeGraphs:
        """Graphs for the shard: `buckets` (else KETTLE_CUDA_GRAPHS), forward only (logits stay eager)."""
        return cls(model, kv_cache, scratch_block, graph_buckets() if buckets is None else buckets)

    def _meta(self, n: int) -> AttentionMetadata:
        """Metadata of an n-sequence decode step whose tensors are views of the static buffers."""
        plan = DecodePlan(
            token_range=(0, n),
            token_indices=None,
            block_ids=self.tables[:n].view(-1),
            num_blocks=self.width,
            query_positions=self.positions[:n].view(-1, 1, 1, 1),
            key_positions=self.key_positions,
        )
        return AttentionMetadata(
            slots=self.slots[:n],
            positions=self.positions[:n],
            last_token_indices=torch.arange(n, device=self.positions.device),
            query_lens=[1] * n,
            cache_lens=[self.max_context - 1] * n,
            block_size=self.block_size,
            # The longest context a replay may see: the RoPE table grows to it before capture.
            max_seq_len=self.max_context,
            decode=plan,
            prefills=[],
        )

    def _run(self, n: int, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = self.model.forward(self.input_ids[:n], self.positions[:n], self.kv_cache, meta)
        return hidden, self.model.compute_logits(hidden) if self.with_logits else None

    @torch.inference_mode()
    def _capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.kv_cache.device)
        # Largest first, so smaller graphs fit in the memory the larger ones already reserved in the pool.
        bar = progress_bar(len(self.buckets), "Capturing CUDA graphs", "graph", enabled=distributed.current().rank == 0)
        for n in reversed(self.buckets):
            meta = self._meta(n)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                # Warm-ups outside the capture: Triton compiles and autotunes, cuBLAS picks its kernels. The chained
                # form (cache written first, as mixed steps and speculation's rows run eagerly) compiles the decode
                # kernel's other variant now rather than at the first such step of serving.
                for _ in range(2):
                    self._run(n, meta)
                self._run(n, replace(meta, chained=True))
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden, logits = self._run(n, meta)
            self._graphs[n] = _Captured(graph, hidden, logits)
            bar.update()
        bar.close()
        # The graphs read the RoPE tables they were captured with: keep them alive if the model ever regrows them.
        tables = getattr(self.model, "layer_rotary", None) or [getattr(self.model, "rotary", None)]
        self._pinned = [(getattr(rotary, "cos", None), getattr(rotary, "sin", None)) for rotary in tables]
        torch.cuda.synchronize()
        logger.info(
            "captured decode CUDA graphs for batch sizes %s (contexts up to %d) in %.1f s",
            ",".join(map(str, self.buckets)),
            self.max_context,
            time.perf_counter() - start,
        )

    def bucket(self, meta: AttentionMetadata) -> int | None:
        """The bucket that serves this step, or None when it must run eagerly."""
        if not meta.decode_only or meta.max_seq_len > self.max_context or meta.decode.num_blocks > self.width:
            return None
        if meta.chained:  # captured with the decode kernel's own cache write, which a chained step must not use
            return None
        n = meta.num_tokens
        return next((size for size in self.buckets if size >= n), None)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> GraphOutput | None:
        """Replays the step's bucket with these inputs; None when the step does not fit a graph."""
        bucket = self.bucket(meta)
        if bucket is None:
            return None
        n, width = meta.num_tokens, meta.decode.num_blocks
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(meta.positions)
        self.slots[:n].copy_(meta.slots)
        self.tables[:n, :width].copy_(meta.decode.block_ids.view(n, width))
        if bucket > n:
            # Earlier, larger steps left real slots in these rows: point them back at the scratch block.
            self.positions[n:bucket].zero_()
            self.slots[n:bucket].fill_(self.scratch_slot)
            self.tables[n:bucket, 0].fill_(self.scratch_block)
        captured = self._graphs[bucket]
        captured.graph.replay()
        logits = None if captured.logits is None else captured.logits[:n]
        return GraphOutput(captured.hidden[:n], logits)

    def replay(self, bucket: int) -> None:
        """Replays `bucket` on whatever inputs its buffers hold (benchmarks time the graph alone this way)."""
        self._graphs[bucket].graph.replay()
