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


def test_cuda_backend_on_cpu_tensors_equals_sdpa():
    """Selecting the CUDA backend must not break a CPU model: it hands CPU tensors to SDPA."""
    torch.manual_seed(0)
    cache_lens, tables = [5, 0, 9], [[3, 1], [2], [4, 5, 0]]
    meta = AttentionMetadata.build([1, 3, 1], cache_lens, tables, 4, "cpu")
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    outs = []
    for name in ("sdpa", "cuda"):
        k_cache, v_cache = torch.zeros(24, 2, 8), torch.zeros(24, 2, 8)
        outs.append(get_backend(name).forward(q, k, v, k_cache, v_cache, meta, 8**-0.5, None))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="available: sdpa, cuda"):
        get_backend("nope")


def test_fp8_linear_on_cpu_is_close_to_dense(monkeypatch):
    monkeypatch.setenv("KETTLE_CPU_LINEAR", "dense")  # fp8 quantizes from the checkpoint layout
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
    monkeypatch.setenv("KETTLE_CPU_LINEAR", "dense")  # as on CUDA, where fp8 runs
    block = torch.nn.Sequential(Linear(torch.randn(16, 16)), torch.nn.ReLU(), Linear(torch.randn(32, 16)))
    model = torch.nn.ModuleDict({"block": block, "lm_head": Linear(torch.randn(8, 32))})
    quantize_fp8(model)
    assert [type(m).__name__ for m in block] == ["Fp8Linear", "ReLU", "Fp8Linear"]
    assert type(model["lm_head"]) is Linear
