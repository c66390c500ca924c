"""The fused CUDA kernels (residual add + RMSNorm, SiLU·up, RoPE) against the eager PyTorch ops they replace.

Each kernel rounds once where the eager chain rounds after every op, so bf16 results match to bf16 precision
(relative error ~4e-3), float32 ones to float32 precision. Without a GPU the kernels run in Triton's interpreter on
CPU tensors (the conftest turns it on), in float32 and float16 (see DTYPES); the whole model with them is checked
on a GPU only (the model takes them for CUDA tensors alone).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kettle.bench.drive import BLOCK_SIZE, scattered_tables
from kettle.layers import cuda_fused
from kettle.layers.rotary import RotaryEmbedding
from kettle.layers.triton_support import INTERPRET
from kettle.models.registry import load_model
from kettle.tensors.kv_cache import KVCache

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
pytestmark = pytest.mark.skipif(
    cuda_fused.triton is None or not (ON_GPU or INTERPRET), reason="needs Triton, and a CUDA GPU or its interpreter"
)

# Triton's interpreter narrows float32 to bfloat16 by truncation, not the GPU's rounding to nearest: there the
# 16-bit checks run in float16, which it rounds as the GPU does.
DTYPES = [torch.float32, torch.bfloat16 if ON_GPU else torch.float16]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "cols"), [(1, 4096), (7, 576), (3, 80)])
def test_add_rms_norm_matches_eager(dtype, rows, cols):
    x, residual = (torch.randn(rows, cols, dtype=dtype, device=DEVICE) for _ in range(2))
    weight = torch.randn(cols, dtype=dtype, device=DEVICE)
    out, new_residual = cuda_fused.add_rms_norm(x, residual, weight, 1e-5)
    total = residual + x
    assert torch.equal(new_residual, total)  # one rounding of an exact float32 sum, as the eager add does
    assert relative_error(out, F.rms_norm(total, (cols,), weight, 1e-5)) < tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width"), [(1, 11008), (5, 1536), (2, 100)])
def test_silu_mul_matches_eager(dtype, rows, width):
    gate_up = torch.randn(rows, 2 * width, dtype=dtype, device=DEVICE)
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert relative_error(cuda_fused.silu_mul(gate_up), F.silu(gate) * up) < tolerance(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "head_dim"), [(1, 32, 32, 128), (6, 9, 3, 64), (3, 4, 2, 80)])
def test_rope_matches_eager(dtype, tokens, heads, kv_heads, head_dim):
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, dtype=dtype, device=DEVICE)
    rope = RotaryEmbedding(head_dim, {"rope_theta": 10000.0}, 4096, dtype, torch.device(DEVICE))
    positions = torch.randint(0, 4096, (tokens,), device=DEVICE)
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


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
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
