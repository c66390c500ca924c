"""The offline driver: Kettle's paged forward and its shard engine run in this process, with no server.

Tests and benchmarks share it. It plays the router's and the shard's parts in the simplest way: each sequence
gets a block table drawn shuffled from one pool (never contiguous), `AttentionMetadata` is built per step and
greedy tokens are fed back in, so callers exercise exactly the interfaces the shard uses. The tests' block size
is `BLOCK_SIZE` (4: short prompts then span several blocks); benchmarks run the served one (`SERVED_BLOCK_SIZE`,
16, which the kernels' fast paths expect) over a cache in the dtype a shard picks by default (`served_cache`).
transformers' own decode step (`hf_decode_step`) is the baseline the decode benchmarks time beside Kettle's.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kettle.layers.attention import AttentionMetadata
from kettle.models.registry import CausalLM
from kettle.proto import generate_pb2 as pb
from kettle.tensors import kv_cache
from kettle.tensors.kv_cache import KVCache

BLOCK_SIZE = 4  # the tests': small, so that even short prompts span several blocks
SERVED_BLOCK_SIZE = kv_cache.BLOCK_SIZE

PROMPTS = [
    "Hi",
    "The capital of France is Paris. The capital of",
    "def add(a, b):\n    return",
    "你好，世界！今天天气很好。 😀 🎉 Large language models generate text",
]


def scattered_tables(lengths: list[int], seed: int = 0, block_size: int = BLOCK_SIZE) -> tuple[list[list[int]], int]:
    """Block tables with enough blocks for each length, drawn shuffled from one pool (never contiguous), and the
    number of blocks a cache needs for them (block 0 stays unused: it is the padding block)."""
    needs = [-(-n // block_size) for n in lengths]
    pool = list(range(1, sum(needs) + 1))
    random.Random(seed).shuffle(pool)
    tables, at = [], 0
    for need in needs:
        tables.append(pool[at : at + need])
        at += need
    return tables, sum(needs) + 1


def new_cache(
    model: CausalLM,
    num_blocks: int,
    kv_dtype: torch.dtype | None = None,
    block_size: int = BLOCK_SIZE,
    device: torch.device | str = "cpu",
) -> KVCache:
    """A cache for `model` in `kv_dtype` (default: the model's dtype)."""
    spec = model.spec
    dtype = kv_dtype or spec.dtype
    return KVCache(spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, dtype, device)


def served_cache(model: CausalLM, num_blocks: int, device: torch.device | str = "cpu") -> KVCache:
    """A cache as a shard keeps it: the served block size, in the KV dtype the shard picks by default (16-bit on
    the CPU under a float32 model)."""
    from kettle.shard.dtype import choose_kv_dtype

    kv_dtype = choose_kv_dtype(None, model.spec.dtype, torch.device(device))
    return new_cache(model, num_blocks, kv_dtype, SERVED_BLOCK_SIZE, device)


def step(
    model: CausalLM, cache: KVCache, chunks: list[list[int]], cache_lens: list[int], tables: list[list[int]]
) -> tuple[torch.Tensor, AttentionMetadata]:
    """One forward over the concatenated chunks; returns logits of every new token [T, vocab] and the metadata."""
    meta = AttentionMetadata.build([len(c) for c in chunks], cache_lens, tables, cache.block_size, cache.device)
    input_ids = torch.tensor([t for chunk in chunks for t in chunk], device=cache.device)
    hidden = model.forward(input_ids, meta.positions, cache, meta)
    return model.compute_logits(hidden), meta


def greedy(model: CausalLM, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Prefills all prompts in one forward, then decodes them together, argmax each step."""
    tables, num_blocks = scattered_tables([len(p) + max_new_tokens for p in prompts])
    cache = new_cache(model, num_blocks)
    logits, meta = step(model, cache, prompts, [0] * len(prompts), tables)
    tokens = logits[meta.last_token_indices].argmax(-1)
    generated = [tokens]
    for i in range(max_new_tokens - 1):
        cache_lens = [len(p) + i for p in prompts]
        logits, meta = step(model, cache, [[t] for t in tokens.tolist()], cache_lens, tables)
        tokens = logits.argmax(-1)
        generated.append(tokens)
    return torch.stack(generated, dim=1).tolist()


def decode_logits(
    model: CausalLM, prompts: list[list[int]], fused: bool, steps: int = 12, adapters: list[int] | None = None
) -> torch.Tensor:
    """Prefills `prompts`, then decodes them together greedily through the fused CPU decode step or layer by
    layer (`fused`); the logits of every decode step [steps, S, V]. `adapters`: each prompt's LoRA adapter (-1:
    the base model) when the model has adapters attached."""
    model.__dict__.pop("cpu_decoder_step", None)
    if not fused:
        model.__dict__["cpu_decoder_step"] = None  # the cached property, overridden: layer by layer
    tables, num_blocks = scattered_tables([len(p) + steps for p in prompts])
    cache = new_cache(model, num_blocks)
    if adapters is not None:
        model.lora_rows.set([a for p, a in zip(prompts, adapters, strict=True) for _ in p], torch.device("cpu"))
    logits, meta = step(model, cache, prompts, [0] * len(prompts), tables)
    tokens, out = logits[meta.last_token_indices].argmax(-1), []
    if adapters is not None:
        model.lora_rows.set(adapters, torch.device("cpu"))
    for i in range(steps):
        logits, _ = step(model, cache, [[t] for t in tokens.tolist()], [len(p) + i for p in prompts], tables)
        out.append(logits)
        tokens = logits.argmax(-1)
    model.__dict__.pop("cpu_decoder_step", None)
    return torch.stack(out)


def decode_hidden(model, graphs, tokens: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
    """One decode step's hidden states: eagerly without `graphs`, else by replay (which must happen)."""
    if graphs is None:
        return model.forward(tokens, meta.positions, cache, meta)
    replayed = graphs.run(tokens, meta)
    assert replayed is not None, "a decode step within the buckets must replay"
    return replayed.hidden


# ---- the benchmarks' loops: what a shard runs per step, timed call by call ----------------------------------


class DecodeLoop:
    """Batched greedy decode as the shard runs it: `batch` prompts of `context` tokens prefilled in one forward,
    then one decode step per call (metadata build + forward + logits + argmax) over contiguous block tables of a
    `served_cache` (or one in `kv_dtype`). `forward` stands in for the model's (a compiled one); every call runs
    inside `around()` (a switch of the kernels, say); `seed` fixes the prompts. The tokens so far: `tokens()`."""

    def __init__(
        self,
        model: CausalLM,
        batch: int,
        context: int,
        steps: int,
        *,
        kv_dtype: torch.dtype | None = None,
        forward: Callable | None = None,
        around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        seed: int | None = None,
    ) -> None:
        self.model, self.batch, self.forward, self.around = model, batch, forward or model.forward, around
        block = SERVED_BLOCK_SIZE
        blocks_per_seq = -(-(context + steps + 1) // block)
        blocks = batch * blocks_per_seq
        self.cache = served_cache(model, blocks) if kv_dtype is None else new_cache(model, blocks, kv_dtype, block)
        self.tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        prompts = torch.randint(0, model.spec.vocab_size, (batch * context,), generator=generator)
        meta = AttentionMetadata.build([context] * batch, [0] * batch, self.tables, block, self.cache.device)
        with self.around(), torch.inference_mode():
            hidden = model.forward(prompts.to(self.cache.device), meta.positions, self.cache, meta)
            first = model.compute_logits(hidden[meta.last_token_indices]).argmax(-1)
        self.length, self.log = context, [first]

    def __call__(self) -> None:
        block = self.cache.block_size
        meta = AttentionMetadata.build(
            [1] * self.batch, [self.length] * self.batch, self.tables, block, self.cache.device
        )
        with self.around(), torch.inference_mode():
            hidden = self.forward(self.log[-1], meta.positions, self.cache, meta)
            self.log.append(self.model.compute_logits(hidden).argmax(-1))
        self.length += 1

    def tokens(self) -> torch.Tensor:
        """The greedy tokens so far, the prefill's first: [batch, steps + 1]."""
        return torch.stack(self.log, 1)


def decode_rate(model: CausalLM, context: int, steps: int) -> float:
    """tok/s of `steps` greedy one-sequence decode steps after a `context`-token prompt, on a fresh served cache."""
    loop = DecodeLoop(model, 1, context, steps)
    start = time.perf_counter()
    for _ in range(steps):
        loop()
    return steps / (time.perf_counter() - start)


class PrefillLoop:
    """One prefill of `ids` per call as the shard's runner runs it, `chunk` tokens a forward (each later chunk
    attends over the earlier ones in the cache), nothing cached before, and the logits of the last position only
    (what a shard computes before sampling the first token); every call runs inside `around()`."""

    def __init__(
        self,
        model: CausalLM,
        ids: torch.Tensor,
        chunk: int | None = None,
        around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        self.model, self.ids, self.chunk, self.around = model, ids, chunk or len(ids), around
        self.cache = served_cache(model, -(-len(ids) // SERVED_BLOCK_SIZE))
        self.table = [list(range(self.cache.num_blocks))]

    def __call__(self) -> int:
        tokens, block = len(self.ids), self.cache.block_size
        with self.around(), torch.inference_mode():
            for start in range(0, tokens, self.chunk):
                end = min(start + self.chunk, tokens)
                meta = AttentionMetadata.build([end - start], [start], self.table, block, self.cache.device)
                hidden = self.model.forward(self.ids[start:end], meta.positions, self.cache, meta)
            return int(self.model.compute_logits(hidden[meta.last_token_indices]).argmax(-1)[-1])


def hf_decode_step(model, batch: int, context: int) -> Callable[[], None]:
    """transformers' own greedy decode step (its model and DynamicCache) per call, after a prefill of `batch`
    random `context`-token prompts."""
    device = next(model.parameters()).device
    prompts = torch.randint(0, model.config.vocab_size, (batch, context), device=device)
    with torch.inference_mode():
        out = model(prompts, use_cache=True)
    state = {"past": out.past_key_values, "tokens": out.logits[:, -1].argmax(-1, keepdim=True)}

    @torch.inference_mode()
    def hf_step() -> None:
        out = model(state["tokens"], past_key_values=state["past"], use_cache=True)
        state["past"], state["tokens"] = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)

    return hf_step


def transformers_model(path: str, dtype: torch.dtype = torch.float32):
    """transformers' model of a Kettle model folder (a GGUF folder's float copy), for the baselines."""
    from transformers import AutoModelForCausalLM

    from kettle.hub.resolve import float_folder

    return AutoModelForCausalLM.from_pretrained(float_folder(path), dtype=dtype).eval()


@contextlib.contextmanager
def environment(**values: str | None):
    """The process's settings read again with these variables set (None: unset), then restored as they were: how a
    benchmark compares a setting's two values in one process (each read where a model loads or a step runs)."""
    from kettle import settings

    def put(variables: dict[str, str | None]) -> None:
        for name, value in variables.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        settings.reload()

    before = {name: os.environ.get(name) for name in values}
    put(values)
    try:
        yield
    finally:
        put(before)


def tuning(items: Mapping[str, object]):
    """`environment` with these KETTLE_TUNING items (a bool as on/off; None drops the key) merged into the
    variable's value now: how a benchmark compares a switch's two values in one process."""
    from kettle import settings

    value = settings.merge_tuning(os.environ.get(settings.TUNING_VARIABLE), items)
    return environment(**{settings.TUNING_VARIABLE: value or None})


# ---- the shard engine in process, called as the router calls it ------------------------------------------------


def shard_engine(path: str, max_tokens: int = 1024, **config):
    """The shard's engine over `path` as a shard builds it (more ShardConfig fields in `config`), warmed up for
    batches of up to `max_tokens` tokens."""
    from kettle.shard.config import ShardConfig
    from kettle.shard.server import build_engine

    engine, _ = build_engine(ShardConfig(model_path=str(path), **config))
    warm = pb.WarmupRequest(max_input_tokens=max_tokens, max_prefill_tokens=max_tokens, max_total_tokens=max_tokens)
    warm.batch.requests.add(id=0, input_ids=[1, 2, 3]).stopping_parameters.max_new_tokens = 1
    engine.warmup(warm)
    return engine


@dataclass(frozen=True)
class EngineRun:
    """One batch run to its end on the engine: tokens generated after each request's first, and the seconds of
    its prefill and of its decode calls."""

    tokens: int
    first_tokens: int
    prefill_s: float
    decode_s: float

    @property
    def decode_rate(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else float("nan")


def engine_run(
    engine,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    max_steps: int = 1,
    ignore_eos: bool = False,
    batch_id: int = 1,
) -> EngineRun:
    """One request per prompt (greedy, its own contiguous blocks), prefilled together and then decoded in calls of
    up to `max_steps` steps (greedy windows where the batch allows them) until every request has finished."""
    cache = getattr(engine.runner, "kv_cache", None)  # None: a transformers runner keeps transformers' caches
    block = cache.block_size if cache is not None else SERVED_BLOCK_SIZE
    batch, at = pb.Batch(id=batch_id), 0
    for i, ids in enumerate(prompts):
        request = batch.requests.add(id=batch_id * 1000 + i, input_ids=ids)
        request.stopping_parameters.max_new_tokens = max_new_tokens
        request.stopping_parameters.ignore_eos_token = ignore_eos
        blocks = -(-(len(ids) + max_new_tokens + 1) // block)
        request.blocks.extend(range(at, at + blocks))
        at += blocks
    assert cache is None or at <= cache.num_blocks, "the warm-up's KV cache is too small for these prompts"
    start = time.perf_counter()
    answer = engine.prefill(pb.PrefillRequest(batch=batch))
    first = sum(len(g.tokens.ids) for g in answer.generations)
    prefilled = time.perf_counter()
    tokens = 0
    while answer.HasField("batch"):
        answer = engine.decode(pb.DecodeRequest(batches=[answer.batch], max_steps=max_steps))
        tokens += sum(len(g.tokens.ids) for g in answer.generations)
    return EngineRun(tokens, first, prefilled - start, time.perf_counter() - prefilled)
