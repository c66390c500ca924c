"""Weight-only int8/int4 layers against dequantized references, the GPTQ/AWQ unpacking against packers
written here from the formats' specs, and the clear errors for the `--quantize` values Kettle lacks."""

from __future__ import annotations

import pytest
import torch

from kettle.catalog import UNSUPPORTED, check_scheme
from kettle.launcher.config import LauncherConfig
from kettle.launcher.specs import shard_spec
from kettle.quantization.awq import ORDER, unpack_awq
from kettle.quantization.int4 import Int4Linear, kernel_group_size, quantize_int4, unpack_int4
from kettle.quantization.int8 import Int8Linear
from kettle.quantization.qparams import QParams, unpack_nibbles
from tests.fixtures import torch_threads

# The packed kernels take bfloat16 activations (kettle/quantization/config.py): relative error ~2^-8 per
# input, accumulated in float32, so outputs match the dequantized float32 product to about 1%.
KERNEL_RTOL = 0.02


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def close(y: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest error relative to the reference's largest magnitude."""
    return float((y - reference).abs().max() / reference.abs().max())


def words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] values 0..15 → int32 words, nibble i at bits 4i (as every 4-bit format here packs them)."""
    value = (nibbles.long() << (4 * torch.arange(8))).sum(-1)
    return torch.where(value >= 2**31, value - 2**32, value).to(torch.int32)


@pytest.mark.parametrize(("out_features", "in_features"), [(48, 64), (96, 256), (64, 576)])
@pytest.mark.parametrize("rows", [1, 5, 200])
def test_int4_linear_matches_its_dequantized_weight(out_features, in_features, rows):
    torch.manual_seed(0)
    layer = Int4Linear.from_weight(torch.randn(out_features, in_features), torch.randn(out_features))
    x = torch.randn(rows, in_features)
    reference = x @ layer.dequantized().t() + layer.bias
    assert close(layer(x), reference) < KERNEL_RTOL  # 200 rows: the dense path (KETTLE_QUANT_DENSE_ROWS)


@pytest.mark.parametrize("in_features", [64, 72])
@pytest.mark.parametrize("rows", [1, 5, 200])
def test_int8_linear_matches_its_dequantized_weight(rows, in_features):
    """Also for an input width that is not a multiple of 16 (72), which neither Kettle's kernel nor PyTorch's
    int8 pack kernel takes (the latter crashed the process): the dense path serves it."""
    torch.manual_seed(0)
    layer = Int8Linear.from_weight(torch.randn(96, in_features))
    x = torch.randn(rows, in_features)
    assert close(layer(x), x @ layer.dequantized().t()) < KERNEL_RTOL


def test_quantization_error_is_within_half_a_step():
    torch.manual_seed(0)
    weight = torch.randn(64, 256)
    int8 = Int8Linear.from_weight(weight)
    assert ((int8.dequantized() - weight).abs() <= int8.scale[:, None] / 2 + 1e-6).all()
    q, scale, zero = quantize_int4(weight, 64)
    params = QParams(q, scale, zero, 64)
    step = scale.t().repeat_interleave(64, dim=1)  # [N, K]
    assert ((params.dequantized() - weight).abs() <= step / 2 + 1e-5).all()


def test_int4_pack_round_trips_including_a_half_block_of_channels():
    q = torch.randint(0, 16, (80, 64), dtype=torch.int32)  # 2 blocks of 32 channels + one of 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    assert torch.equal(unpack_int4(packed, 80, 64), q)


def test_group_size_falls_back_to_one_the_kernel_has():
    assert kernel_group_size(576, 128) == 64  # SmolLM2's hidden size
    assert kernel_group_size(1536, 128) == 128
    with pytest.raises(ValueError, match="group size"):
        kernel_group_size(48, 128)


def test_a_group_larger_than_the_kernels_is_split_exactly():
    torch.manual_seed(0)
    q = torch.randint(0, 16, (32, 1024), dtype=torch.int32)
    scale, zero = torch.rand(2, 32) + 0.1, torch.randn(2, 32)  # groups of 512: more than the kernel's 256
    layer = Int4Linear.from_qparams(q, scale, zero, 512)
    assert layer.group_size == 256
    # The kernel keeps scales and zeros in its activation dtype (bfloat16): compare with those values.
    rounded = QParams(q, scale.bfloat16().float(), zero.bfloat16().float(), 512)
    assert torch.allclose(layer.dequantized(), rounded.dequantized(), atol=1e-5)


def test_gptq_words_unpack_along_the_input_dimension():
    q = torch.randint(0, 16, (64, 48), dtype=torch.int32)  # [K, N] as GPTQ orders it
    qweight = words(q.view(8, 8, 48).permute(0, 2, 1))  # [K/8, N]: input channels 8r..8r+7 in word r
    assert torch.equal(unpack_nibbles(qweight.t()).t(), q)


def test_awq_words_unpack_in_the_interleaved_order():
    q = torch.randint(0, 16, (4, 32), dtype=torch.int32)  # [K, N]
    nibble_values = q.view(4, 4, 8)[..., list(ORDER)]  # nibble i holds channel ORDER[i]
    assert torch.equal(unpack_awq(words(nibble_values)), q)


@pytest.mark.parametrize("value", [*UNSUPPORTED, "fp8", "nf4-typo"])
def test_values_without_a_cpu_kernel_name_the_alternatives(value):
    with pytest.raises(ValueError) as error:
        check_scheme(value, "cpu")
    message = str(error.value)
    assert "int8" in message and "int4" in message and value in message


def test_weight_only_schemes_run_on_cuda_too():
    """Measured on an H100 (int8 1.68x bf16 at one sequence, int4 2.17x): no longer behind a switch."""
    for value in ("int8", "int4", "gptq", "awq"):
        check_scheme(value, "cuda")
    with pytest.raises(ValueError, match="CPU and on NVIDIA GPUs only"):
        check_scheme("int4", "mps")


@pytest.mark.parametrize("value", ["int8", "int4", "gptq", "awq"])
def test_launcher_passes_cpu_schemes_to_the_shard(monkeypatch, value):
    monkeypatch.setattr("kettle.launcher.config.cuda_available", lambda: False)
    config = LauncherConfig(quantize=value)
    assert config.shard_config("/m", rank=0).quantize == value
    argv = shard_spec(config, "/m", rank=0).argv
    assert argv[argv.index("--quantize") + 1] == value


@pytest.mark.parametrize("value", ["bitsandbytes", "marlin", "exl2"])
def test_launcher_refuses_the_others_before_starting(monkeypatch, value):
    monkeypatch.setattr("kettle.launcher.config.cuda_available", lambda: False)
    with pytest.raises(ValueError, match="--quantize int8 or int4"):
        LauncherConfig(quantize=value)
