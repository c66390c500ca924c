"""Kettle's prefill kernels (kettle/kernels/gemm.c) against PyTorch references."""

from __future__ import annotations

import ctypes
import shutil

import pytest
import torch
import torch.nn.functional as F

from kettle.kernels import build, ops
from kettle.quantization.int8 import Int8Linear
from kettle.quantization.q4 import Q4Linear

CAN_BUILD = shutil.which("gcc") is not None and set(build.REQUIRED_CPU_FLAGS) <= build._cpu_flags()
pytestmark = pytest.mark.skipif(not CAN_BUILD, reason="needs gcc and an AVX2/FMA/F16C CPU")
AVX512 = "avx512f" in build._cpu_flags()


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


@pytest.fixture(params=["avx2", "avx512"])
def micro_kernel(request):
    """Runs a test with each GEMM micro-kernel this CPU has."""
    if request.param == "avx512" and not AVX512:
        pytest.skip("no AVX-512 here")
    choice = ctypes.c_int.in_dll(build.library(), "kettle_gemm_avx512")
    choice.value = int(request.param == "avx512")
    yield request.param
    choice.value = -1


# Row counts: whole tiles and tails of both micro-kernels (6 and 12 rows); 100 channels end in a short panel.
@pytest.mark.parametrize("rows", [132, 133, 137])
@pytest.mark.parametrize(("out_features", "group_size"), [(100, 32), (96, 64)])
def test_q4_gemm_is_its_dequantized_weight(micro_kernel, rows, out_features, group_size):
    torch.manual_seed(rows)
    weight, bias, x = torch.randn(out_features, 192) * 0.05, torch.randn(out_features), torch.randn(rows, 192)
    layer = Q4Linear.from_weight(weight, bias, group_size)
    assert rows >= ops.GEMM_ROWS
    assert relative(layer(x), F.linear(x, layer.dequantized(), bias)) < 1e-5


@pytest.mark.parametrize("rows", [128, 139])
def test_q8_gemm_is_its_dequantized_weight(micro_kernel, rows):
    torch.manual_seed(rows)
    layer = Int8Linear.from_weight(torch.randn(72, 96), torch.randn(72))
    x = torch.randn(rows, 96)
    assert relative(layer(x), F.linear(x, layer.dequantized(), layer.bias)) < 1e-5


def test_gemm_rows_switch_keeps_the_float32_tiles(monkeypatch):
    """`KETTLE_CPU_GEMM_ROWS=0` (never the GEMM) gives the same products through the float32 tiles."""
    layer = Q4Linear.from_weight(torch.randn(64, 128) * 0.05, group_size=32)
    x = torch.randn(150, 128)
    fast = layer(x)
    monkeypatch.setattr(ops, "GEMM_ROWS", 1 << 62)
    assert relative(fast, layer(x)) < 1e-5

