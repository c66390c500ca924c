"""Weight-only int8/int4 on CUDA: the layers against their dequantized weights, the tiny model quantized at load
time against a bf16 model running the weights quantization rounds to, GPTQ/AWQ checkpoints, and decode graphs.

All but the layout checks (a Python copy of PyTorch's tinygemm packing kernel, and the Triton kernel's nibble pairs, run
on the CPU too) and the two Triton kernels alone (run on the CPU in Triton's interpreter) are skipped without a CUDA
device. int4 runs PyTorch's tinygemm kernel (or, with
KETTLE_TUNING=cuda-int4-kernel=triton, kettle/quantization/int4_cuda.py's; the layer tests check both), a dense GEMM
past `dense_rows`; int8 the Triton GEMV of kettle/quantization/fp8.py (≤ INT8_GEMV_ROWS rows) or a bf16 GEMM.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kettle.layers.triton_support import INTERPRET
from kettle.models.registry import load_model
from kettle.quantization import int4_cuda
from kettle.quantization.int4 import Int4Linear, quantize_int4, unpack_int4_cuda
from kettle.quantization.int8 import Int8Linear
from tests.fixtures import make_tiny_llama
from tests.models.test_cuda_path import PROMPTS, decode, prefill_logits
from tests.models.test_quantized import PROJECTIONS, make_prequantized

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# The Triton kernels alone run on a GPU, or in Triton's interpreter on CPU tensors (the conftest turns it on).
needs_triton_here = pytest.mark.skipif(
    int4_cuda.triton is None or not (torch.cuda.is_available() or INTERPRET), reason="needs Triton"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# One layer: bf16 activations and outputs against a float32 product with the same (bf16-rounded) weights.
LAYER_RTOL = 2e-2
# Whole tiny model, both sides bf16 with the same effective weights: only rounding differs, which this
# model's large random weights amplify (the fp8 test allows 0.3 against bf16 for the same reason).
MODEL_RTOL = 0.1


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected.float()).norm() / expected.float().norm())


def tinygemm_pack(q: torch.Tensor, tiles: int) -> torch.Tensor:
    """A line-by-line Python copy of PyTorch's CUDA packing kernel (`matrix_to_m16n8k16_Bint4_layout` in
    aten/src/ATen/native/cuda/int4mm.cu, NVIDIA branch), from the uint8 pairs it reads."""
    n, k = q.shape
    pairs = ((q[:, ::2] << 4) | q[:, 1::2]).tolist()
    out = torch.zeros(n // 8, k // (16 * tiles), 32, tiles // 2, dtype=torch.int64)
    for n_tile, k_outer, t in itertools.product(range(n // 8), range(k // (16 * tiles)), range(32)):
        for inner in range(0, tiles, 2):
            row = pairs[n_tile * 8 + t // 4]
            base0 = (k_outer * tiles + inner) * 16 // 2
            base1 = base0 + 16 // 2
            v = [row[base0 + t % 4], row[base0 + t % 4 + 4], row[base1 + t % 4], row[base1 + t % 4 + 4]]
            low = (v[3] & 0xF) << 28 | (v[2] & 0xF) << 24 | (v[1] & 0xF) << 20 | (v[0] & 0xF) << 16
            high = (v[3] & 0xF0) << 8 | (v[2] & 0xF0) << 4 | (v[1] & 0xF0) | (v[0] & 0xF0) >> 4
            out[n_tile, k_outer, t, inner // 2] = low | high
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


@pytest.mark.parametrize("tiles", [2, 4, 8])
def test_unpack_int4_cuda_inverts_tinygemm_packing(tiles):
    """On the CPU against the Python copy of the kernel; on a GPU also the copy against the kernel itself."""
    q = torch.randint(0, 16, (24, 16 * tiles * 3), dtype=torch.int32)
    packed = tinygemm_pack(q, tiles)
    assert torch.equal(unpack_int4_cuda(packed, *q.shape), q)
    if torch.cuda.is_available():
        pairs = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).cuda()
        assert torch.equal(torch.ops.aten._convert_weight_to_int4pack(pairs, tiles).cpu(), packed)


def test_int4_pairs_layout_and_dense_weight():
    """The Triton kernel's layout: input 2j in byte j's low nibble, 2j + 1 in its high one, inverted exactly; the
    dense weight of a large call is w = (q - 8)·scale + zero per group."""
    q, scale, zero = quantize_int4(torch.randn(48, 96), 32)
    pairs = int4_cuda.pack_pairs(q)
    assert pairs.shape == (48, 48) and pairs.dtype == torch.uint8
    assert torch.equal(pairs[:, 0] & 0xF, q[:, 0].to(torch.uint8))
    assert torch.equal(pairs[:, 0] >> 4, q[:, 1].to(torch.uint8))
    assert torch.equal(int4_cuda.unpack_pairs(pairs).long(), q.long())
    expected = ((q.view(48, -1, 32) - 8) * scale.t()[..., None] + zero.t()[..., None]).view(48, 96)
    got = int4_cuda.dense_weight(pairs, torch.stack([scale, zero], -1), 32, torch.float32)
    assert torch.allclose(got, expected, atol=1e-6)


@needs_cuda
@pytest.mark.parametrize(
    ("n", "k", "group"), [(1056, 1024, 128), (64, 96, 32), (4096, 11008, 128), (576, 1536, 64), (1024, 4096, 256)]
)
@pytest.mark.parametrize("rows", [1, 5, 17, 32, 33, 64, 128, 300, 600])
@pytest.mark.parametrize("kernel", ["triton", "tinygemm"])
def test_int4_layer_matches_its_dequantized_weight(n, k, group, rows, kernel):
    """Each CUDA kernel's layout (nibble order; tinygemm's k-tiling) and its w = (q - 8)·scale + zero against the
    CPU formula, at row counts around the Triton kernel's row blocks (16, 32, 64) and its partial tiles (K = 96,
    N = 1056); past `dense_rows` (tinygemm 128, Triton 256) the dense path (unpacked weight, cuBLAS)."""
    weight = torch.randn(n, k) * 0.02
    q, scale, zero = quantize_int4(weight, group)
    scale, zero = scale.bfloat16().float(), zero.bfloat16().float()  # the kernels keep them in bf16
    expected_weight = ((q.view(n, -1, group) - 8) * scale.t()[..., None] + zero.t()[..., None]).view(n, k)
    layer = Int4Linear(q.cuda(), scale.cuda(), zero.cuda(), group, cuda_kernel=kernel)
    assert layer.cuda_kernel == kernel
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert relative_error(got, F.linear(x.float(), expected_weight.cuda())) < LAYER_RTOL
    if rows == 1:
        assert relative_error(layer.dequantized().cpu(), expected_weight) < 1e-2


@needs_cuda
@pytest.mark.parametrize("rows", [1, 24])
def test_int4_triton_takes_float16_activations(rows):
    """A float16 model's rows go to the Triton kernel as they are (tinygemm would cast them to bf16)."""
    q, scale, zero = quantize_int4(torch.randn(256, 512) * 0.02, 128)
    layer = Int4Linear(q.cuda(), scale.cuda(), zero.cuda(), 128, cuda_kernel="triton")
    x = torch.randn(rows, 512, device="cuda", dtype=torch.float16)
    got = layer(x)
    assert got.dtype == torch.float16
    assert relative_error(got, F.linear(x.float(), layer.dequantized())) < LAYER_RTOL


@needs_triton_here
@pytest.mark.parametrize(("n", "k", "group"), [(64, 96, 32), (48, 256, 128)])
@pytest.mark.parametrize("rows", [1, 17, 40])
def test_int4_triton_kernel_matches_its_dequantized_weight(n, k, group, rows):
    """The Triton int4 kernel itself, compiled on a GPU or in Triton's interpreter on the CPU (float16 there: the
    interpreter's `tl.dot` takes bfloat16 as raw bits), at a partial K tile (96) and a partial N tile (48), one
    group per tile and several, at each row block (16, 32, 64)."""
    q, scale, zero = quantize_int4(torch.randn(n, k) * 0.02, group)
    scale_zero = torch.stack([scale, zero], -1).to(torch.float16)
    expected = int4_cuda.dense_weight(int4_cuda.pack_pairs(q), scale_zero.float(), group, torch.float32)
    x = torch.randn(rows, k, dtype=torch.float16)
    pairs = int4_cuda.pack_pairs(q).to(DEVICE)
    got = int4_cuda.int4_matmul(x.to(DEVICE), pairs, scale_zero.to(DEVICE), group)
    assert got.dtype == torch.float16 and got.shape == (rows, n)
    assert relative_error(got.cpu(), F.linear(x.float(), expected)) < LAYER_RTOL


@needs_triton_here
@pytest.mark.parametrize("weight_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("rows", [1, 16, 40])
def test_weight_only_gemv_kernel_matches_its_dequantized_weight(weight_dtype, rows):
    """The Triton GEMV of int8 and fp8 weights (kettle/quantization/fp8.py), compiled or interpreted, with a partial
    N tile: x (weight · scale)ᵀ against the same product in float32."""
    from kettle.quantization.fp8 import fp8_gemv

    weight = (torch.randn(96 + 8, 512) * 40).clamp(-127, 127).round().to(weight_dtype)
    scale = torch.rand(96 + 8) * 0.01 + 0.001
    x = torch.randn(rows, 512, dtype=torch.float16)
    got = fp8_gemv(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE))
    assert got.dtype == torch.float16 and got.shape == (rows, 96 + 8)
    expected = F.linear(x.float(), weight.float() * scale[:, None])
    assert relative_error(got.cpu(), expected) < LAYER_RTOL


@needs_cuda
@pytest.mark.parametrize("rows", [1, 16, 40, 200])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_layer_matches_its_dequantized_weight(rows, dtype):
    """≤ 64 rows: the Triton GEMV (several 16-row programs per weight tile past 16); 200: the dense path."""
    weight, bias = torch.randn(4096 + 48, 1024, device="cuda") * 0.02, torch.randn(4096 + 48, device="cuda")
    layer = Int8Linear.from_weight(weight, bias)
    x = torch.randn(2, rows, 1024, device="cuda", dtype=dtype)
    got = layer(x)
    assert got.dtype == dtype and got.shape == (2, rows, 4096 + 48)
    assert relative_error(got, F.linear(x.float(), layer.dequantized(), bias)) < LAYER_RTOL


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    # intermediate 256 and hidden 64: every projection has a kernel group size (the CPU tests use the same).
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), intermediate_size=256)


def with_weights(source: Path, target: Path, replaced: dict[str, torch.Tensor]) -> Path:
    """Dense `source` copied to `target` with some tensors replaced (a checkpoint of rounded weights)."""
    target.mkdir()
    for file in source.iterdir():
        if file.name not in ("model.safetensors", "config.json"):
            (target / file.name).write_bytes(file.read_bytes())
    (target / "config.json").write_text((source / "config.json").read_text())
    replaced = {name: tensor.contiguous() for name, tensor in replaced.items()}
    save_file(load_file(source / "model.safetensors") | replaced, target / "model.safetensors")
    return target


def rounded_like_kettle(source: Path, method: str) -> dict[str, torch.Tensor]:
    """The weights `--quantize method` serves on CUDA, dequantized on the CPU: projections from the bf16 weights
    the loader reads, and the LM head in int8 (KETTLE_QUANT_LM_HEAD's default)."""
    rounded = {}
    for name, weight in load_file(source / "model.safetensors").items():
        if name.rsplit(".", 2)[-2] in PROJECTIONS:
            w = weight.bfloat16().float()
            layer = Int8Linear.from_weight(w) if method == "int8" else Int4Linear.from_weight(w, group_size=None)
            rounded[name] = layer.dequantized()
        elif name == "lm_head.weight":
            rounded[name] = Int8Linear.from_weight(weight.bfloat16().float()).dequantized()
    return rounded


@needs_cuda
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_tiny_model_matches_bf16_on_its_rounded_weights(tiny, tmp_path, method):
    reference = load_model(
        str(with_weights(tiny, tmp_path / "ref", rounded_like_kettle(tiny, method))), torch.bfloat16, "cuda"
    )
    model = load_model(str(tiny), torch.bfloat16, "cuda", quantize=method)
    expected_layer = Int8Linear if method == "int8" else Int4Linear
    assert isinstance(model.layers[0].mlp.down, expected_layer) and isinstance(model.lm_head, Int8Linear)
    prompts = [[5, 9, 11, 40, 3], [7] * 13, [1, 2, 3], list(range(20, 50))]
    for batch in (prompts, prompts[:1]):  # 51 rows (int8: dense path) and 5 rows (int8: the GEMV)
        assert relative_error(prefill_logits(model, batch), prefill_logits(reference, batch)) < MODEL_RTOL


@needs_cuda
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_decode_graphs_give_eager_tokens(tiny, method):
    """The quantized kernels capture in decode CUDA graphs; greedy tokens stay in the vocabulary."""
    model = load_model(str(tiny), torch.bfloat16, "cuda", quantize=method)
    eager_tokens, _ = decode(model, 10, None)
    graph_tokens, _ = decode(model, 10, (1, 2, 8))
    assert graph_tokens == eager_tokens
    vocab = model.spec.vocab_size
    assert all(0 <= t < vocab for step in eager_tokens for t in step) and len(eager_tokens[0]) == len(PROMPTS)


@needs_cuda
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_prequantized_checkpoint_on_cuda_matches_its_dequantized_weights(tiny, tmp_path, method):
    dequantized = make_prequantized(tiny, tmp_path / method, method)
    rounded = {name: weight.bfloat16() for name, weight in dequantized.items()}
    reference = load_model(str(with_weights(tiny, tmp_path / "ref", rounded)), torch.bfloat16, "cuda")
    model = load_model(str(tmp_path / method), torch.bfloat16, "cuda")  # found from config.json
    assert isinstance(model.layers[0].attn.qkv, Int4Linear) and model.layers[0].attn.qkv.on_cuda
    prompts = [[5, 9, 11, 40, 3], list(range(20, 50))]
    assert relative_error(prefill_logits(model, prompts), prefill_logits(reference, prompts)) < MODEL_RTOL
