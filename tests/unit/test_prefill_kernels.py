"""Kettle's prefill kernels (kettle/kernels/gemm.c) against PyTorch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kettle.kernels import ops
from kettle.quantization.int8 import Int8Linear
from kettle.quantization.q4 import Q4Linear
from kettle.quantization.q8 import Q8Linear
from tests.fixtures import kernel_switch, kernels_buildable, vector_width
from tests.kernel_weights import INT8_RTOL, reference

CAN_BUILD = kernels_buildable()
pytestmark = pytest.mark.skipif(not CAN_BUILD, reason="needs gcc, an AVX2/FMA/F16C CPU and the kernels on")


FAST = "batch-invariant=off"


@pytest.fixture(autouse=True)
def fast_paths(monkeypatch):
    """These tests pick the panels by their row-count thresholds (linear.c), which only choose with batch invariance
    off (tests/unit/test_batch_invariance.py holds the invariant paths)."""
    monkeypatch.setenv("KETTLE_TUNING", FAST)


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


@pytest.fixture(params=["avx2", "avx512"])
def micro_kernel(request, monkeypatch):
    """Runs a test with each GEMM micro-kernel this CPU has (the float32 panels, not the integer ones)."""
    monkeypatch.setenv("KETTLE_TUNING", f"{FAST},integer-gemm=off")
    with vector_width("kettle_gemm_avx512", request.param == "avx512"):
        yield request.param


@pytest.fixture(params=["avx2", "avx512"])
def attention_kernel(request):
    """Runs a test with each prefill attention kernel this CPU has."""
    with vector_width("kettle_attention_avx512", request.param == "avx512"):
        yield request.param


# Row counts: whole tiles and tails of both micro-kernels (6 and 12 rows); 100 channels end in a short panel.
@pytest.mark.parametrize("rows", [132, 133, 137])
@pytest.mark.parametrize(("out_features", "group_size"), [(100, 32), (96, 64)])
def test_q4_gemm_is_its_dequantized_weight(micro_kernel, rows, out_features, group_size):
    torch.manual_seed(rows)
    weight, bias, x = torch.randn(out_features, 192) * 0.05, torch.randn(out_features), torch.randn(rows, 192)
    layer = Q4Linear.from_weight(weight, bias, group_size)
    assert ops.path(layer.describe(), rows) == "gemm"
    assert relative(layer(x), F.linear(x, layer.dequantized(), bias)) < 1e-5


@pytest.mark.parametrize("rows", [128, 139])
def test_q8_gemm_is_its_dequantized_weight(micro_kernel, rows):
    torch.manual_seed(rows)
    layer = Int8Linear.from_weight(torch.randn(72, 96), torch.randn(72))
    x = torch.randn(rows, 96)
    assert relative(layer(x), F.linear(x, layer.dequantized(), layer.bias)) < 1e-5


def test_gemm_rows_switch_keeps_the_float32_tiles(monkeypatch):
    """`KETTLE_TUNING=gemm-rows=0` (never the GEMM) gives the same products through the float32 tiles (in rows: a
    weight in lanes keeps its quantized rows below the panels)."""
    monkeypatch.setenv("KETTLE_TUNING", f"{FAST},integer-gemm=off,lanes=off")
    layer = Q4Linear.from_weight(torch.randn(64, 128) * 0.05, group_size=32)
    x = torch.randn(150, 128)
    fast = layer(x)
    monkeypatch.setenv("KETTLE_TUNING", f"{FAST},integer-gemm=off,lanes=off,gemm-rows=0")
    assert ops.path(layer.describe(), 150) == "tiles"
    assert relative(fast, layer(x)) < 1e-5


def _q8_0_layer(out_features: int, in_features: int) -> Q8Linear:
    q = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8)
    return Q8Linear(q, (torch.rand(out_features, in_features // 32) * 0.01 + 1e-3).half(), torch.randn(out_features))


LAYERS = {
    "q4-group32": lambda n, k: Q4Linear.from_weight(torch.randn(n, k) * 0.05, torch.randn(n), 32),
    "q4-group64": lambda n, k: Q4Linear.from_weight(torch.randn(n, k) * 0.05, None, 64),
    "int8": lambda n, k: Int8Linear.from_weight(torch.randn(n, k), torch.randn(n)),
    "q8_0": _q8_0_layer,
}


@pytest.mark.skipif(not CAN_BUILD or not ops.integer_gemm(), reason="needs AVX-512 VNNI")
@pytest.mark.parametrize("rows", [10, 16, 23, 40])
@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_integer_panels_are_the_dense_product_of_int8_rows(monkeypatch, kind, rows):
    """The integer panels (prompt chunks and decode steps from 10 rows) quantize each row to int8 per block of 32 and
    sum exact integer block products (less the type's offset times the inputs' sum) with the same scales: the dense
    weight times the int8-rounded rows, float32 rounding apart. 100 output channels end in a short group of
    channels; 10 rows fill part of one group of 16 lanes, 23 and 40 rows end in a group of 8 rows or fewer (the
    8-lane micro-kernel)."""
    torch.manual_seed(rows)
    layer = LAYERS[kind](100, 192)
    x = torch.randn(rows, 192) * torch.linspace(0.1, 4.0, 192)  # uneven channels, as activations have
    assert ops.path(layer.describe(), rows) == "int_gemm"
    panels = layer(x)
    assert relative(panels, reference(layer, x, int8=True)) < INT8_RTOL
    # the float32 panels, exact to the dequantized weight (which start at 16 rows by default)
    monkeypatch.setenv("KETTLE_TUNING", f"{FAST},integer-gemm=off,gemm-rows={min(16, rows)}")
    assert ops.path(layer.describe(), rows) == "gemm"
    assert relative(layer(x), reference(layer, x, int8=False)) < 1e-5
    assert 1e-4 < relative(panels, layer(x)) < 2e-2


@pytest.mark.skipif(not CAN_BUILD or not ops.integer_gemm(), reason="needs AVX-512 VNNI")
@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_integer_panels_eight_lane_groups_are_the_sixteen_lane_sums(kind):
    """A group of 8 rows or fewer runs 8 lanes (256-bit vpdpbusd) instead of 16 padded ones: the same products,
    sums and scales per lane, so the same bits (18 = 16 + 2 and 40 = 2 × 16 + 8 rows)."""
    torch.manual_seed(1)
    layer = LAYERS[kind](100, 192)
    for rows in (18, 40):
        x = torch.randn(rows, 192)
        eight = layer(x)
        with kernel_switch("kettle_integer_lanes8", 0):
            sixteen = layer(x)
        assert torch.equal(eight, sixteen)


# 6, 18 and 19 blocks of 32 inputs: scales combined 8 at a time, then the rest one by one; Q8_0's odd last block.
@pytest.mark.parametrize(
    ("kind", "k"), [("q4-group32", 192), ("q4-group32", 576), ("q4-group64", 576), ("q8_0", 192), ("q8_0", 608)]
)
@pytest.mark.parametrize("avx512", [False, True], ids=["avx2", "avx512"])
def test_one_row_channels_are_the_tiles_sums(kind, k, avx512):
    """One row of decode runs kernels.h's `q4_channel_one` / `q8g_channel_one` (scales combined before the loop, the
    minimums' term in the same vector; in 256- or 512-bit vectors): the same integer block products and scales as the
    tiles' kernel, summed in another order, so equal to float32 rounding; and both within the int16 activations' bound
    of the dequantized weight."""
    if avx512 and not ops.vnni():
        pytest.skip("no AVX-512 VNNI here")
    torch.manual_seed(k)
    layer = LAYERS[kind](100, k)
    x = torch.randn(1, k) * torch.linspace(0.1, 4.0, k)
    with vector_width("kettle_channel_avx512", avx512):
        fast = layer(x)
    with kernel_switch("kettle_channel_one", 0):
        tiles = layer(x)
    assert relative(fast, tiles) < 2e-6
    assert relative(fast, F.linear(x, layer.dequantized(), layer.bias)) < 2e-4


def reference_attention(q, k, v, positions, window):
    """q [L, H, D] at `positions`, k/v [C, Hkv, D] at 0 .. C-1 → [L, H, D], causal (and windowed), in float64."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("lhd,chd->hlc", q.double(), k) * q.shape[-1] ** -0.5
    keys = torch.arange(k.shape[0])
    allowed = keys[None, :] <= positions[:, None]
    if window is not None:
        allowed &= keys[None, :] > positions[:, None] - window
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hlc,chd->lhd", probs, v).float()


# (new tokens, cached prefix, window): one query tile, tails of both tiles, a prefix, a window inside the chunk; from
# 1,024 keys on the items take twice the query rows (prefill_attention.c LONG_KEYS): a long prefix under a short chunk
# whose last item is short, and a chunk crossing the threshold itself under a window.
CASES = [(5, 0, None), (37, 0, None), (40, 19, None), (100, 64, 24), (33, 7, 50), (150, 1000, None), (1030, 0, 300)]


@pytest.mark.parametrize(("tokens", "cache_len", "window"), CASES)
# Head sizes: 64 and 128 (each a constant in the AVX2 kernel), 80 (a tail of one vector of 16), 72 (not whole vectors
# of 16: AVX2 even where AVX-512 is asked for).
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 128), (6, 2, 80), (4, 2, 72)])
def test_paged_prefill_matches_attention_over_scattered_blocks(
    attention_kernel, tokens, cache_len, window, heads, kv_heads, dim
):
    torch.manual_seed(tokens + dim)
    block_size, context = 16, cache_len + tokens
    blocks = -(-context // block_size)
    table = torch.randperm(blocks + 5)[:blocks]  # scattered, and the pool holds blocks of nobody
    k_cache = torch.randn((blocks + 5) * block_size, kv_heads, dim)
    v_cache = torch.randn_like(k_cache)
    slots = (table[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:context]
    stale = torch.ones(len(k_cache), dtype=torch.bool).index_fill_(0, slots, False)
    k_cache[stale], v_cache[stale] = float("nan"), float("nan")  # slots past the context must not leak in
    # The fused qkv output's layout: q heads, then k and v heads, in each token's row.
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim)
    q = qkv[:, :heads]
    got = ops.paged_prefill(q, k_cache, v_cache, table, cache_len, block_size, dim**-0.5, window)
    positions = torch.arange(cache_len, context)
    expected = reference_attention(q, k_cache[slots], v_cache[slots], positions, window)
    assert relative(got, expected) < 1e-5


def test_cache_write_is_index_copy_from_views_of_the_fused_qkv_output():
    torch.manual_seed(0)
    qkv = torch.randn(37, 9 + 2 * 3, 64)
    k_new, v_new = qkv[:, 9:12], qkv[:, 12:]
    slots = torch.randperm(100)[:37]
    k_cache, v_cache = torch.randn(100, 3, 64), torch.randn(100, 3, 64)
    expected_k, expected_v = k_cache.clone().index_copy_(0, slots, k_new), v_cache.clone().index_copy_(0, slots, v_new)
    assert ops.cache_write_fits(k_new, v_new, k_cache, v_cache)
    ops.cache_write(k_new, v_new, slots, k_cache, v_cache)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
