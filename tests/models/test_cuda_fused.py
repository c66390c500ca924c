"""The fused CUDA kernels (residual add + RMSNorm, SiLU·up, RoPE) against the eager PyTorch ops they replace.

Skipped without a CUDA device. Each kernel rounds once where the eager chain rounds after every op, so bf16
results match to bf16 precision (relative error ~4e-3), float32 ones to float32 precision.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kettle.bench.drive import BLOCK_SIZE, scattered_tables
from kettle.layers import cuda_fused
from kettle.layers.rotary import RotaryEmbedding
from kettle.models.registry import load_model
from kettle.tensors.kv_cache import KVCache

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or cuda_fused.triton is None, reason="needs a CUDA GPU and Triton"
)

DTYPES = [torch.float32, torch.bfloat16]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), [(1, 4096), (7, 576), (3, 80)])
def test_add_rms_norm_matches_eager(dtype, rows, cols):
    x, residual = (torch.randn(rows, cols, dtype=dtype, device="cuda") for _ in range(2))
    weight = torch.randn(cols, dtype=dtype, device="cuda")
    out, new_residual = cuda_fused.add_rms_norm(x, residual, weight, 1e-5)
    total = residual + x
    assert torch.equal(new_residual, total)  # one rounding of an exact float32 sum, as the eager add does
    assert relative_error(out, F.rms_norm(total, (cols,), weight, 1e-5)) < tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width"), [(1, 11008), (5, 1536), (2, 100)])
def test_silu_mul_matches_eager(dtype, rows, width):
    gate_up = torch.randn(rows, 2 * width, dtype=dtype, device="cuda")
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert relative_error(cuda_fused.silu_mul(gate_up), F.silu(gate) * up) < tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "head_dim"), [(1, 32, 32, 128), (6, 9, 3, 64), (3, 4, 2, 80)])
def test_rope_matches_eager(dtype, tokens, heads, kv_heads, head_dim):
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, dtype=dtype, device="cuda")
    rope = RotaryEmbedding(head_dim, {"rope_theta": 10000.0}, 4096, dtype, torch.device("cuda"))
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    cos, sin = rope.cos[positions], rope.sin[positions]
    qk = qkv[:, : heads + kv_heads]  # a strided view, as in the attention layer
    expected = (qk.float() * cos.float()).addcmul_(qk.float().roll(head_dim // 2, dims=-1), sin.float())
    assert relative_error(cuda_fused.rope_qk(qk, cos, sin), expected) < tolerance(dtype)


def _last_logits(model, prompt: list[int]) -> torch.Tensor:
    from kettle.layers.attention import AttentionMetadata

    spec = model.spec
    tables, num_blocks = scattered_tables([len(prompt)])
    cache = KVCache(spec.num_layers, num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, spec.dtype, "cuda")
    meta = AttentionMetadata.build([len(prompt)], [0], tables, BLOCK_SIZE, "cuda")
    ids = torch.tensor(prompt, device="cuda")
    hidden = model.forward(ids, meta.positions, cache, meta)
    return model.compute_logits(hidden[-1:])


def test_model_with_fused_kernels_matches_eager(tiny_llama_path, monkeypatch):
    """The whole bf16 model with and without KETTLE_TUNING's cuda-fused-kernels: same logits to bf16 precision."""
    model = load_model(str(tiny_llama_path), torch.bfloat16, "cuda")
    prompt = [5, 9, 11, 40, 3, 7, 7, 1]
    monkeypatch.setenv("KETTLE_TUNING", "cuda-fused-kernels=on")
    fused = _last_logits(model, prompt)
    monkeypatch.setenv("KETTLE_TUNING", "cuda-fused-kernels=off")
    eager = _last_logits(model, prompt)
    assert relative_error(fused, eager) < 2e-2
    assert fused.argmax().item() == eager.argmax().item()
