"""Each element-wise op picks its implementation once, from where its tensors live (kettle/layers/backend.py)."""

from __future__ import annotations

import pytest
import torch

from kettle.kernels import ops
from kettle.layers.backend import Backend, choose
from kettle.layers.norm import RMSNorm
from kettle.layers.rotary import RotaryEmbedding
from tests.fixtures import cpu_kernels
from tests.unit.test_cpu_kernels import CAN_BUILD

pytestmark = pytest.mark.skipif(not CAN_BUILD, reason="needs gcc and an AVX2/FMA/F16C CPU")


def test_float32_cpu_tensors_take_the_c_kernels_and_others_pytorch():
    assert choose(torch.ones(4)) is Backend.C
    assert choose(torch.ones(4, dtype=torch.bfloat16)) is Backend.TORCH
    with cpu_kernels(False):
        assert choose(torch.ones(4)) is Backend.TORCH


def test_a_norm_keeps_the_backend_it_was_built_with(monkeypatch):
    """Built with the kernels off, a norm stays on PyTorch's ops even once they are on again: no per-call
    re-derivation (the C kernel is never called)."""
    with cpu_kernels(False):
        norm = RMSNorm(torch.rand(16) + 0.5, 1e-6)
    assert norm.backend is Backend.TORCH
    monkeypatch.setattr(ops, "rms_norm", lambda *args: pytest.fail("the C kernel was called"))
    x = torch.randn(3, 16)
    torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (16,), norm.weight, 1e-6))


def test_rotary_tables_rotate_on_their_own_backend():
    params = {"rope_theta": 10000.0}
    rotary = RotaryEmbedding(16, params, 64, torch.float32, torch.device("cpu"))
    assert rotary.backend is Backend.C and rotary.rotate_fn == rotary.apply_halves
    with cpu_kernels(False):
        plain = RotaryEmbedding(16, params, 64, torch.float32, torch.device("cpu"))
    assert plain.backend is Backend.TORCH
    x, positions = torch.randn(5, 3, 16), torch.arange(5)
    cos, sin = rotary.cos[positions], rotary.sin[positions]
    torch.testing.assert_close(rotary.apply_halves(x, cos, sin), plain.apply_halves(x, cos, sin), atol=1e-6, rtol=0)
