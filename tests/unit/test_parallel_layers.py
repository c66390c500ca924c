"""Tensor-parallel layers and a tensor-parallel engine on 2 real gloo ranks (two spawned processes).

Each rank loads only its slice of a small safetensors checkpoint; the sharded layers must reproduce the dense
layer, and a sharded engine must produce the same tokens on both ranks (greedy and seeded sampling: every
rank samples from the same all-gathered logits with the same seeds) and the greedy tokens of one shard.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

from kettle.bench.process import free_port
from kettle.layers.parallel import HeadSplit, head_split, split_range, vocab_block
from kettle.proto import generate_pb2 as pb
from kettle.tensors.distributed import TensorParallel

HIDDEN, HEAD_DIM, HEADS, VOCAB = 16, 4, 4, 7  # an odd vocabulary: the last rank's block is padded
WORLD = 2
# Engine-level models: Llama with 6 heads in 3 KV groups (the 2 ranks hold 2 and 1 KV heads, an uneven split),
# Llama with tied embeddings and a single KV head (replicated on both ranks), and the families that share
# Llama's tensor-parallel blocks: Qwen3 (per-head q/k norms) and Gemma (scaled embeddings, GELU gate).
MODELS = {
    "uneven": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3),
    "tied_kv1": dict(tie_word_embeddings=True, num_key_value_heads=1),
    "qwen3": "Qwen3",
    "gemma": "Gemma",
}


def make_model(path: Path, shape: dict | str) -> str:
    """A tiny checkpoint: Llama with `shape`'s settings, or the transformers family named by `shape`."""
    import transformers

    from tests.fixtures import make_tiny_llama
    from tests.models.family_parity import save_tiny, tiny_settings

    if isinstance(shape, dict):
        return str(make_tiny_llama(path, **shape))
    config = getattr(transformers, f"{shape}Config")(**tiny_settings(path), pad_token_id=0)
    return str(save_tiny(path, config, getattr(transformers, f"{shape}ForCausalLM")))


# gloo on the CPU: with CUDA the shards would run NCCL, which needs a GPU per rank (and a GPU reference).
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (gloo) tensor-parallel test")
PROMPTS = [[5, 17, 99, 3, 250], [42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]


def dense_tensors() -> dict[str, torch.Tensor]:
    """A checkpoint with every kind of projection: q/k/v with 1 or 2 KV heads, gate/up/down, o with bias."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    tensors = {"q.weight": rand(HEADS * HEAD_DIM, HIDDEN), "q.bias": rand(HEADS * HEAD_DIM)}
    for kv in (1, 2):
        tensors |= {f"k{kv}.weight": rand(kv * HEAD_DIM, HIDDEN), f"v{kv}.weight": rand(kv * HEAD_DIM, HIDDEN)}
    tensors |= {"gate.weight": rand(24, HIDDEN), "up.weight": rand(24, HIDDEN), "down.weight": rand(HIDDEN, 24)}
    tensors |= {"o.weight": rand(HIDDEN, HEADS * HEAD_DIM), "o.bias": rand(HIDDEN), "embed.weight": rand(VOCAB, HIDDEN)}
    return tensors


def _layers(rank: int, folder: Path) -> dict[str, float]:
    """Largest error of each sharded layer against its dense version, on this rank."""
    import torch.nn.functional as F

    from kettle.layers.parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        vocab_parallel_embedding,
        vocab_parallel_head,
        vocab_rows,
    )
    from kettle.tensors.weights import Weights

    dense = dense_tensors()
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    errors = {}
    with Weights(folder, torch.float32, "cpu") as weights:
        tp = weights.tp
        gate, up = (split_range(24, tp),) * 2
        got = ColumnParallelLinear.load(weights, ["gate", "up"])(x)
        want = torch.cat(
            [F.linear(x, dense["gate.weight"][slice(*gate)]), F.linear(x, dense["up.weight"][slice(*up)])], 1
        )
        errors["gate_up"] = (got - want).abs().max().item()
        for kv in (1, 2):
            got = ColumnParallelLinear.load_qkv(weights, ["q", f"k{kv}", f"v{kv}"], HEAD_DIM)(x)
            split = head_split(HEADS, kv, tp)
            q, k = (slice(a * HEAD_DIM, b * HEAD_DIM) for a, b in (split.q, split.kv))
            parts = [F.linear(x, dense["q.weight"][q], dense["q.bias"][q])]
            parts += [F.linear(x, dense[f"{n}{kv}.weight"][k]) for n in "kv"]
            errors[f"qkv_kv{kv}"] = (got - torch.cat(parts, 1)).abs().max().item()
        cols = slice(*split_range(HIDDEN, tp))
        got = RowParallelLinear.load(weights, "o")(x[:, cols])
        errors["row"] = (got - F.linear(x, dense["o.weight"], dense["o.bias"])).abs().max().item()
        got = RowParallelLinear.load(weights, "down")(torch.cat([x, x[:, :8]], 1)[:, slice(*split_range(24, tp))])
        errors["row_down"] = (got - F.linear(torch.cat([x, x[:, :8]], 1), dense["down.weight"])).abs().max().item()
        rows = vocab_rows(weights, "embed.weight")
        ids = torch.tensor([0, 3, 4, 6, 6, 1])
        got = vocab_parallel_embedding(ids, rows, tp)
        errors["embedding"] = (got - F.embedding(ids, dense["embed.weight"])).abs().max().item()
        got = vocab_parallel_head(rows, VOCAB, tp)(x)
        errors["lm_head"] = (got - x @ dense["embed.weight"].t()).abs().max().item()
        errors["rows"] = float(rows.shape[0] != vocab_block(VOCAB, tp))
    return errors


def _engine_tokens(model_path: str, rank: int, world_size: int) -> dict[int, list[int]]:
    """Every request's tokens from this rank's runner (all requests, not only the ones this rank reports)."""
    from kettle.shard.config import ShardConfig
    from kettle.shard.server import build_engine

    engine, _info = build_engine(ShardConfig(model_path=model_path, rank=rank, world_size=world_size))
    warm = pb.WarmupRequest(max_input_tokens=64, max_prefill_tokens=64, max_total_tokens=128)
    warm.batch.requests.add(id=0, input_ids=[1, 2, 3]).stopping_parameters.max_new_tokens = 1
    engine.warmup(warm)
    batch = pb.Batch(id=1)
    for i, ids in enumerate(PROMPTS * 2):
        request = batch.requests.add(id=i, input_ids=ids)
        request.stopping_parameters.max_new_tokens = 8
        request.stopping_parameters.ignore_eos_token = True
        request.blocks.extend(range(i * 4, i * 4 + 4))
        if i >= len(PROMPTS):  # the second copy samples, seeded per request
            request.parameters.do_sample, request.parameters.seed, request.parameters.temperature = True, 7 + i, 1.5
    engine.world_size = 1  # report every request's generations on every rank (the router merges them)
    tokens: dict[int, list[int]] = {}
    response = engine.prefill(pb.PrefillRequest(batch=batch))
    while True:
        for generation in response.generations:
            tokens.setdefault(generation.request_id, []).extend(generation.tokens.ids)
        if not response.HasField("batch"):
            return tokens
        response = engine.decode(pb.DecodeRequest(batches=[response.batch]))


def _worker(rank: int, folder: str, models: dict[str, str], port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    from kettle.tensors import distributed

    distributed.init_distributed(rank, WORLD, torch.device("cpu"))
    try:
        tokens = {name: _engine_tokens(path, rank, WORLD) for name, path in models.items()}
        result = {"layers": _layers(rank, Path(folder)), "tokens": tokens}
    finally:
        distributed.shutdown()
    torch.save(result, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of 2 gloo ranks computed (layers against dense, engine tokens), plus one shard's tokens."""
    folder = tmp_path_factory.mktemp("tp-layers")
    save_file({k: v.contiguous() for k, v in dense_tensors().items()}, folder / "model.safetensors")
    models = {name: make_model(tmp_path_factory.mktemp(name), shape) for name, shape in MODELS.items()}
    out = tmp_path_factory.mktemp("tp-out")
    mp.spawn(_worker, args=(str(folder), models, free_port(), str(out)), nprocs=WORLD, join=True)
    results = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    single = {name: _engine_tokens(path, 0, 1) for name, path in models.items()}
    torch.set_num_threads(before)
    return results, single


@pytest.mark.parametrize("layer", ["gate_up", "qkv_kv1", "qkv_kv2", "row", "row_down", "embedding", "lm_head", "rows"])
def test_sharded_layer_matches_the_dense_layer(ranks, layer):
    results, _single = ranks
    for rank, result in enumerate(results):
        assert result["layers"][layer] < 1e-5, f"rank {rank}: {layer} differs by {result['layers'][layer]}"


@pytest.mark.parametrize("model", MODELS)
def test_every_rank_produces_the_same_tokens(ranks, model):
    results, _single = ranks
    assert results[0]["tokens"][model] == results[1]["tokens"][model]
    assert len(results[0]["tokens"][model]) == 2 * len(PROMPTS)
    assert all(len(tokens) == 8 for tokens in results[0]["tokens"][model].values())


@pytest.mark.parametrize("model", MODELS)
def test_two_shards_generate_the_greedy_tokens_of_one(ranks, model):
    results, single = ranks
    greedy = range(len(PROMPTS))
    assert {i: results[0]["tokens"][model][i] for i in greedy} == {i: single[model][i] for i in greedy}


def test_heads_split_with_their_kv_heads_or_replicate_them():
    def splits(heads: int, kv: int, world: int) -> list[HeadSplit]:
        return [head_split(heads, kv, TensorParallel(rank, world, group=object())) for rank in range(world)]

    assert splits(8, 8, 4) == [HeadSplit((2 * r, 2 * r + 2), (2 * r, 2 * r + 2)) for r in range(4)]
    # SmolLM2-135M: 9 heads in 3 KV groups over 2 ranks run as 6 + 3.
    assert splits(9, 3, 2) == [HeadSplit((0, 6), (0, 2)), HeadSplit((6, 9), (2, 3))]
    # One KV head (multi-query) replicated on every rank, which split its query heads.
    assert splits(4, 1, 2) == [HeadSplit((0, 2), (0, 1)), HeadSplit((2, 4), (0, 1))]
    assert splits(8, 2, 4) == [
        HeadSplit((0, 2), (0, 1)),
        HeadSplit((2, 4), (0, 1)),
        HeadSplit((4, 6), (1, 2)),
        HeadSplit((6, 8), (1, 2)),
    ]
    with pytest.raises(ValueError, match="cannot be split"):
        splits(6, 2, 4)
    assert [split_range(5, TensorParallel(r, 2, group=object())) for r in range(2)] == [(0, 3), (3, 5)]
    assert vocab_block(7, TensorParallel(0, 4, group=object())) == 2


def test_types_that_cannot_split_are_refused_in_one_line_with_the_reason(tmp_path, monkeypatch):
    from kettle import catalog

    (tmp_path / "config.json").write_text('{"model_type": "t5"}')  # served by transformers' own code
    with pytest.raises(ValueError, match="'t5' does not support tensor parallelism") as refused:
        catalog.check_tensor_parallel_folder(str(tmp_path), 2)
    assert catalog.FALLBACK_REASON in str(refused.value) and "\n" not in str(refused.value)
    catalog.check_tensor_parallel_folder(str(tmp_path), 1)  # one shard: any type
    # A native family that names why it cannot split is refused with that reason, before any shard starts.
    family = catalog.Family("gpt2", "GPT2ForCausalLM", no_tensor_parallel="its ALiBi slopes are not sliced")
    monkeypatch.setitem(catalog.NATIVE, "gpt2", family)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    message = "'gpt2' does not support tensor parallelism .--num-shard 2.: its ALiBi slopes are not sliced; run it"
    with pytest.raises(ValueError, match=message):
        catalog.check_tensor_parallel_folder(str(tmp_path), 2)


def test_every_native_family_splits():
    from kettle.catalog import NATIVE

    assert [model_type for model_type, family in NATIVE.items() if not family.tensor_parallel] == []
