"""The CUDA-path pieces that need no GPU: graph bucket settings, backend selection, fp8 numerics on the CPU."""

from __future__ import annotations

import pytest
import torch

from kettle.layers.attention import AttentionMetadata, get_backend
from kettle.layers.linear import Linear
from kettle.quantization.fp8 import Fp8Linear, quantize_fp8, quantize_rows
from kettle.shard.cuda_graphs import DEFAULT_BUCKETS, graph_buckets, graphs_enabled


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, DEFAULT_BUCKETS), ("0", ()), ("", ()), ("8,1, 2", (1, 2, 8)), ("4", (4,))],
)
def test_graph_buckets_from_setting(value, expected, monkeypatch):
    monkeypatch.delenv("KETTLE_CUDA_GRAPHS", raising=False)
    assert graph_buckets(value) == expected


def test_graph_buckets_reject_negative_sizes():
    with pytest.raises(ValueError, match="KETTLE_CUDA_GRAPHS"):
        graph_buckets("-1,2")


def test_graphs_never_apply_on_cpu():
    assert not graphs_enabled(torch.device("cpu"))


def test_cuda_backend_on_cpu_tensors_equals_sdpa(monkeypatch):
    """Selecting the CUDA backend must not break a CPU model: it hands CPU tensors to SDPA (unless Triton's
    interpreter is on, as the tests turn it on without a GPU: off here)."""
    from kettle.layers import cuda_attention

    monkeypatch.setattr(cuda_attention, "INTERPRET", False, raising=False)
    torch.manual_seed(0)
    cache_lens, tables = [5, 0, 9], [[3, 1], [2], [4, 5, 0]]
    meta = AttentionMetadata.build([1, 3, 1], cache_lens, tables, 4, "cpu")
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    outs = []
    for name in ("sdpa", "cuda"):
        k_cache, v_cache = torch.zeros(24, 2, 8), torch.zeros(24, 2, 8)
        outs.append(get_backend(name).forward(q, k, v, k_cache, v_cache, meta, 8**-0.5, None))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_chained_steps_never_replay_a_graph():
    """Speculation's rows read each other's new K/V: the graphs, captured with the decode kernel's own cache write,
    must not serve them (DecodeGraphs.bucket reads only these attributes)."""
    from types import SimpleNamespace

    from kettle.shard.cuda_graphs import DecodeGraphs

    graphs = SimpleNamespace(buckets=(1, 2, 4), max_context=64, width=16)
    for chained, bucket in ((False, 4), (True, None)):
        meta = AttentionMetadata.build([1, 1, 1], [5, 6, 7], [[3, 1]] * 3, 4, "cpu", chained=chained)
        assert DecodeGraphs.bucket(graphs, meta) == bucket


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="available: sdpa, cuda"):
        get_backend("nope")


def test_fp8_linear_on_cpu_is_close_to_dense(monkeypatch):
    monkeypatch.setenv("KETTLE_TUNING", "cpu-linear=dense")  # fp8 quantizes from the checkpoint layout
    torch.manual_seed(0)
    dense = Linear(torch.randn(48, 64) * 0.05, torch.randn(48))
    fp8 = Fp8Linear.from_linear(dense)
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.scale.shape == (48,)
    x = torch.randn(5, 64)
    expected = dense(x)
    assert float((fp8(x) - expected).norm() / expected.norm()) < 0.05


def test_quantize_rows_round_trip():
    x = torch.randn(4, 100) * torch.tensor([[0.01], [1.0], [30.0], [0.0]])
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (4, 1)
    torch.testing.assert_close(q.float() * scale, x, rtol=0.07, atol=1e-6)


def test_quantize_fp8_swaps_every_linear_but_the_lm_head(monkeypatch):
    monkeypatch.setenv("KETTLE_TUNING", "cpu-linear=dense")  # as on CUDA, where fp8 runs
    block = torch.nn.Sequential(Linear(torch.randn(16, 16)), torch.nn.ReLU(), Linear(torch.randn(32, 16)))
    model = torch.nn.ModuleDict({"block": block, "lm_head": Linear(torch.randn(8, 32))})
    quantize_fp8(model)
    assert [type(m).__name__ for m in block] == ["Fp8Linear", "ReLU", "Fp8Linear"]
    assert type(model["lm_head"]) is Linear


def test_kv_cache_takes_the_cuda_fraction_of_free_gpu_memory(monkeypatch):
    """On CUDA the plan uses --cuda-memory-fraction of the free memory, not the CPU fraction."""
    from types import SimpleNamespace

    from kettle.proto import generate_pb2 as pb
    from kettle.shard import warmup

    spec = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    per_token = 2 * 2 * 2 * 8 * 4
    monkeypatch.setattr(warmup, "_available_bytes", lambda device: 1000 * per_token)
    monkeypatch.setenv("KETTLE_TUNING", f"max-kv-tokens={1 << 20}")
    request = pb.WarmupRequest(max_total_tokens=16, max_prefill_tokens=16)
    cuda = warmup.plan_kv_cache(spec, torch.device("cuda"), request, cpu_fraction=0.1, cuda_fraction=0.5)
    cpu = warmup.plan_kv_cache(spec, torch.device("cpu"), request, cpu_fraction=0.1, cuda_fraction=0.5)
    assert cuda.num_blocks * cuda.block_size == 500 // cuda.block_size * cuda.block_size
    assert cpu.num_blocks * cpu.block_size == 100 // cpu.block_size * cpu.block_size


def test_fused_kernels_never_apply_on_cpu(monkeypatch):
    from kettle.layers.cuda_fused import fused_enabled

    assert not fused_enabled(torch.zeros(2))
    monkeypatch.setenv("KETTLE_TUNING", "cuda-fused-kernels=off")
    assert not fused_enabled(torch.zeros(2))
