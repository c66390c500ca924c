"""The CUDA model path on the tiny Llama: decode CUDA graphs, fp8 linears, the runner hook (the Triton attention
kernels: test_triton_attention.py).

Skipped without a CUDA device. Graph replay must give exactly the eager greedy tokens (padded buckets
included), and fp8 must stay close to bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kettle.bench.drive import BLOCK_SIZE, decode_hidden, scattered_tables
from kettle.layers.attention import AttentionMetadata
from kettle.models.registry import load_model
from kettle.tensors.kv_cache import KVCache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[5, 9, 11, 40, 3], [7] * 13, [1, 2, 3], list(range(20, 50))]


@pytest.fixture(scope="module")
def bf16_model(tiny_llama_path):
    return load_model(str(tiny_llama_path), torch.bfloat16, "cuda")


def decode(model, steps: int, buckets: tuple[int, ...] | None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decode of PROMPTS; through decode graphs of `buckets` when given, else eagerly."""
    from kettle.shard.cuda_graphs import DecodeGraphs

    spec = model.spec
    tables, num_blocks = scattered_tables([len(p) + steps for p in PROMPTS])
    cache = KVCache(spec.num_layers, num_blocks + 1, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, spec.dtype, "cuda")
    graphs = DecodeGraphs(model, cache, num_blocks, buckets) if buckets else None
    meta = AttentionMetadata.build([len(p) for p in PROMPTS], [0] * len(PROMPTS), tables, BLOCK_SIZE, "cuda")
    ids = torch.tensor([t for p in PROMPTS for t in p], device="cuda")
    hidden = model.forward(ids, meta.positions, cache, meta)
    tokens = model.compute_logits(hidden[meta.last_token_indices]).argmax(-1)
    lens, history, all_logits = [len(p) for p in PROMPTS], [tokens.tolist()], []
    for _ in range(steps - 1):
        meta = AttentionMetadata.build([1] * len(PROMPTS), lens, tables, BLOCK_SIZE, "cuda")
        logits = model.compute_logits(decode_hidden(model, graphs, tokens, meta, cache))
        tokens = logits.argmax(-1)
        lens = [n + 1 for n in lens]
        history.append(tokens.tolist())
        all_logits.append(logits)
    return history, all_logits


@pytest.mark.parametrize("buckets", [(4,), (1, 2, 8)])
def test_graph_replay_gives_eager_tokens(bf16_model, buckets):
    """(4,): the batch fills its bucket exactly; (1, 2, 8): 4 sequences padded to 8."""
    eager_tokens, eager_logits = decode(bf16_model, 12, None)
    graph_tokens, graph_logits = decode(bf16_model, 12, buckets)
    assert graph_tokens == eager_tokens
    for graph, eager in zip(graph_logits, eager_logits, strict=True):
        torch.testing.assert_close(graph, eager, atol=0.05, rtol=0.02)


def prefill_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    """Logits of every prompt token in one forward (the same inputs for any model)."""
    spec = model.spec
    tables, num_blocks = scattered_tables([len(p) for p in prompts])
    cache = KVCache(spec.num_layers, num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, spec.dtype, "cuda")
    meta = AttentionMetadata.build([len(p) for p in prompts], [0] * len(prompts), tables, BLOCK_SIZE, "cuda")
    ids = torch.tensor([t for p in prompts for t in p], device="cuda")
    return model.compute_logits(model.forward(ids, meta.positions, cache, meta))


def test_fp8_logits_close_to_bf16(tiny_llama_path, bf16_model):
    """Teacher-forced (same tokens for both), so one flipped greedy choice cannot compound."""
    fp8 = load_model(str(tiny_llama_path), torch.bfloat16, "cuda", quantize="fp8")
    assert type(fp8.layers[0].mlp.down).__name__ == "Fp8Linear"
    # This tiny model's large random weights amplify any rounding (bf16 itself is off fp32 by several %);
    # the per-layer accuracy is checked tightly in test_fp8_linear_kernels_match_dequantized_reference.
    for prompts in (PROMPTS, PROMPTS[:1]):  # 51 rows: fp8 tensor-core GEMMs; 5 rows: the weight-only kernel
        reference, got = prefill_logits(bf16_model, prompts), prefill_logits(fp8, prompts)
        assert float((got - reference).norm() / reference.norm()) < 0.3


@pytest.mark.parametrize("rows", [1, 5, 16, 64])
def test_fp8_linear_kernels_match_dequantized_reference(rows):
    """Rows ≤ 16 take the Triton weight-only kernel, more take _scaled_mm with quantized activations."""
    from kettle.layers.linear import Linear
    from kettle.quantization.fp8 import Fp8Linear

    dense = Linear(torch.randn(4096 + 32, 1024, device="cuda", dtype=torch.bfloat16) * 0.02)
    fp8 = Fp8Linear.from_linear(dense)
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
    reference = F.linear(x.float(), fp8.weight.float() * fp8.scale[:, None])
    got = fp8(x).float()
    assert float((got - reference).norm() / reference.norm()) < (1e-2 if rows <= 16 else 6e-2)
    assert float((got - dense(x).float()).norm() / dense(x).float().norm()) < 0.08


def generate(engine, prompts: list[list[int]], max_new_tokens: int) -> dict[int, list[int]]:
    """Prefill then decode to the end through the engine, as the router would; request id → tokens."""
    from kettle.proto import generate_pb2 as pb

    batch, next_block = pb.Batch(id=1), 0
    for i, ids in enumerate(prompts):
        blocks = -(-(len(ids) + max_new_tokens) // 16)
        request = batch.requests.add(id=i, input_ids=ids)
        request.stopping_parameters.max_new_tokens = max_new_tokens
        request.stopping_parameters.ignore_eos_token = True
        request.blocks.extend(range(next_block, next_block + blocks))
        next_block += blocks
    tokens: dict[int, list[int]] = {}
    response = engine.prefill(pb.PrefillRequest(batch=batch))
    while True:
        for generation in response.generations:
            tokens.setdefault(generation.request_id, []).extend(generation.tokens.ids)
        if not response.HasField("batch"):
            return tokens
        response = engine.decode(pb.DecodeRequest(batches=[response.batch]))


def test_runner_replays_graphs_with_eager_tokens(tiny_llama_path, monkeypatch):
    """The shard engine with decode graphs generates the same greedy tokens as without them."""
    from kettle.proto import generate_pb2 as pb
    from kettle.shard.config import ShardConfig
    from kettle.shard.engine import ShardEngine
    from kettle.shard.runner import PagedRunner
    from kettle.shard.vocab import Vocab

    config = ShardConfig(model_path=str(tiny_llama_path))
    model = load_model(config.model_path, torch.bfloat16, "cuda")
    vocab = Vocab.load(config.model_path, False)
    results = []
    for setting in ("0", "1,2,4,8"):
        monkeypatch.setenv("KETTLE_CUDA_GRAPHS", setting)
        runner = PagedRunner(model, vocab, torch.device("cuda"), (config.watermark_gamma, config.watermark_delta))
        engine = ShardEngine(runner, config.cpu_kv_cache_fraction)
        warm = pb.WarmupRequest(max_input_tokens=200, max_prefill_tokens=256, max_total_tokens=256)
        warm.batch.requests.add(id=0, input_ids=[1, 2, 3]).stopping_parameters.max_new_tokens = 1
        engine.warmup(warm)
        assert (runner.graphs is not None) == (setting != "0")
        results.append(generate(engine, PROMPTS[:3], 10))
    assert results[0] == results[1]
