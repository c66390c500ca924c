"""Kettle's CPU kernels against the PyTorch ops they replace: the layouts' round trips and file values, attention,
the row ops, the build. Every weight type's products on every path: tests/unit/test_weight_types.py."""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kettle import settings
from kettle.kernels import build, ops, structs
from kettle.layers.attention import AttentionMetadata
from kettle.layers.rotary import RotaryEmbedding
from kettle.layers.sdpa_attention import SdpaBackend
from kettle.quantization.kernel_weight import KernelWeight
from kettle.quantization.q4 import Q4Linear, pack_q4, unpack_q4
from kettle.quantization.q8 import Q8Linear
from tests.fixtures import kernels_buildable, torch_threads, vector_width
from tests.kernel_weights import (
    INT8_RTOL,
    int8_reads,
    int8_rows,
    int8_span,
    lanes_here,
    random_q4_k_blocks,
    random_q6_k_blocks,
    reference,
    with_lanes,
)

CAN_BUILD = kernels_buildable()
pytestmark = pytest.mark.skipif(not CAN_BUILD, reason="needs gcc, an AVX2/FMA/F16C CPU and the kernels on")
# int16 activations (per block of 32, absmax scaling): measured ≤ 6e-5 of the largest output on random data.
QUANTIZED_ACTIVATION_RTOL = 2e-4


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def test_the_kernels_build_here_and_switch_off(monkeypatch):
    build.library.cache_clear()
    assert ops.available()
    monkeypatch.setenv("KETTLE_TUNING", build.OFF_SWITCH)
    build.library.cache_clear()
    try:
        assert not ops.available()
    finally:
        monkeypatch.delenv("KETTLE_TUNING")
        build.library.cache_clear()


def prefetches_by_function(library: Path) -> dict[str, int]:
    """The prefetch instructions of each function of the library, from its disassembly."""
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True)
    counts: dict[str, int] = {}
    function = ""
    for line in listing.stdout.splitlines():
        if line.endswith(">:"):
            function = line.split("<", 1)[1][:-2]
        elif "\tprefetch" in line:
            counts[function] = counts.get(function, 0) + 1
    return counts


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")
def test_the_tiles_keep_their_prefetch():
    """GCC 12 once dropped every prefetch of the tiles (a helper inlined into always-inline target functions), and
    nothing but the decode's speed showed it: the Q6L tiles and the lanes tiles from two rows a pass ask for theirs."""
    counts = prefetches_by_function(build.built_folder() / build.LIBRARY)
    tiles = ("q6l_rows", "q4l_rows", "q5l_rows", "iq4l_rows", "q8l_rows", "q6l_rows_maddubs", "q5l_rows_maddubs")
    for function in tiles:
        assert counts.get(function, 0) > 0, function


def test_q4_packing_round_trips():
    q = torch.randint(0, 16, (48, 128), dtype=torch.int32)
    assert torch.equal(unpack_q4(pack_q4(q)), q)


def test_a_quantized_weight_is_the_quantization_of_the_original():
    """`--quantize int4`: the dequantized weight lies within half a step of every group of the float weight."""
    weight = torch.randn(80, 256) * 0.05
    for group_size in (32, 64, 128):
        assert relative(Q4Linear.from_weight(weight, None, group_size).dequantized(), weight) < 0.2


def symmetric_pair(n: int = 40, k: int = 576) -> tuple[Q4Linear, Q4Linear]:
    """A Q4_0-like layer (every minimum -8 · its scale, so none is stored) and the same layer with them stored."""
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales = (torch.rand(n, k // 32) * 0.02 + 1e-3).half().float()
    symmetric = Q4Linear.from_groups(pack_q4(q), scales, -8 * scales, 32, torch.randn(n))
    stored = Q4Linear.from_groups(pack_q4(q), scales, -8 * scales, 32, symmetric.bias.data)
    stored.mins = -8 * stored.scales
    return symmetric, stored


@pytest.mark.parametrize("rows", [1, 3, 8, 17])
def test_a_symmetric_q4_weight_stores_no_minimums_and_computes_the_same_bits(monkeypatch, rows):
    torch.manual_seed(rows)
    symmetric, stored = symmetric_pair()
    assert symmetric.mins is None and stored.mins is not None
    x = torch.randn(rows, 576)
    assert torch.equal(symmetric.dequantized(), stored.dequantized())
    for path in structs.PATHS:  # every path the weight's type has
        if path != "int_gemm" or ops.integer_gemm():
            assert torch.equal(ops.linear_on(x, symmetric.describe(), path), ops.linear_on(x, stored.describe(), path))
    for avx512 in (False, True):  # the one-row channels at both widths
        with vector_width("kettle_channel_avx512", avx512):
            assert torch.equal(symmetric(x[:1]), stored(x[:1]))
    monkeypatch.setattr(ops, "available", lambda: False)  # PyTorch's ops: the minimums from the scales
    assert torch.equal(symmetric.dequantized(), stored.dequantized())


def assert_lanes_products(lanes: KernelWeight, rows: KernelWeight) -> None:
    """A weight in lanes against the same weight in rows, at decode and prompt row counts (batch invariance off,
    each on its fastest path): where both take the integer panels, the same outputs (the same widened weights);
    elsewhere the lanes kernels give the dense product of the int8-rounded rows, to float32 rounding."""
    k = lanes.in_features
    for count in (1, 2, 3, 4, 5, 8, 9, 16, 40, 130):
        x = torch.randn(count, k)
        got, want = lanes(x), rows(x)
        paths = ops.path(lanes.describe(), count), ops.path(rows.describe(), count)
        if paths == ("int_gemm", "int_gemm"):
            assert torch.equal(got, want), count
            continue
        assert int8_reads(lanes.describe(), paths[0]), paths
        assert relative(got, reference(rows, x, int8=True)) < INT8_RTOL, count


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("symmetric", [False, True], ids=["minimums", "symmetric"])
def test_the_lanes_layout_holds_the_rows_weight_and_computes_its_products(monkeypatch, symmetric, group):
    """A weight in lanes (GGUF's groups of 32, `--quantize int4`'s 128) is the rows layout's, moved: the same
    dequantized values and table rows, the layout round-trips, and every path's outputs match the rows layout's."""
    if not lanes_here():
        pytest.skip("the lanes layout needs AVX-512 VNNI")
    from kettle.quantization import q4

    monkeypatch.setenv("KETTLE_TUNING", "batch-invariant=off")
    torch.manual_seed(3)
    n, k = 96, 512
    packed = pack_q4(torch.randint(0, 16, (n, k), dtype=torch.uint8))
    scales = torch.rand(n, k // group) * 0.02 + 1e-3
    mins = -8 * scales if symmetric else -torch.rand(n, k // group) * 0.1
    lanes = Q4Linear.from_groups(packed, scales, mins, group, torch.randn(n))
    rows = with_lanes(False, lambda: Q4Linear.from_groups(packed, scales, mins, group, lanes.bias.data))
    assert lanes.lanes and not rows.lanes and (lanes.mins is None) == symmetric
    back = q4.from_lanes(lanes.packed, lanes.scales, lanes.mins)
    assert all(a is b or torch.equal(a, b) for a, b in zip(back, (rows.packed, rows.scales, rows.mins), strict=True))
    assert torch.equal(lanes.dequantized(), rows.dequantized())
    ids = torch.tensor([0, 95, 17, 16, 15])
    assert torch.equal(lanes.embed(ids), rows.embed(ids))
    with monkeypatch.context() as patch:
        patch.setattr(ops, "available", lambda: False)  # the tensor-op path reads lanes too
        assert torch.equal(lanes.dequantized(), rows.dequantized())
    assert_lanes_products(lanes, rows)


def test_a_q4_k_weight_in_lanes_keeps_the_files_scales(monkeypatch):
    """GGUF's Q4_K in lanes keeps its 6-bit scales as bytes with each super-block's d and dmin (148 bytes a channel's
    256 weights, not the 160 of float16 scale products): its dequantized values are gguf's own, bit for bit, on the
    kernels and on the tensor-op path (tests/unit/test_weight_types.py multiplies it on every path). Where the weight
    is not in lanes it takes the float16 products, as before."""
    if not lanes_here():
        pytest.skip("the lanes layout needs AVX-512 VNNI")
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    from kettle.quantization.gguf_blocks import int4_groups
    from kettle.quantization.gguf_scheme import int4_linear
    from kettle.tensors.gguf_file import Blocks

    n, k = 96, 768
    data = random_q4_k_blocks(n, k, seed=5)
    files = torch.from_numpy(dequantize(data, T.Q4_K)).float()
    groups = int4_groups(Blocks(data, T.Q4_K, n, k, None))
    layer = int4_linear(groups, torch.randn(n))
    assert layer.lanes and layer.supers is not None
    assert sum(t.numel() * t.element_size() for t in (*layer.tables(), layer.supers)) == n * k // 256 * 148
    assert torch.equal(layer.dequantized(), files)
    with monkeypatch.context() as patch:
        patch.setattr(ops, "available", lambda: False)  # the tensor-op path reads the same scales
        assert torch.equal(layer.dequantized(), files)
    rows = with_lanes(False, lambda: int4_linear(groups, None))
    assert rows.supers is None and rows.scales.dtype == torch.float16
    products = Q4Linear.from_groups(groups.values, groups.scales, groups.mins, 32)
    assert torch.equal(rows.dequantized(), products.dequantized())


def test_a_q6_k_weight_in_lanes_holds_the_files_values_in_its_row_order():
    """GGUF's Q6_K in lanes: the file's 210 bytes per 256 weights stay 6.56 bits a weight as stored (384 bytes a
    block of 32 for 16 channels, the scale tables beside), its dequantized values gguf's own bit for bit, in the file's
    row order where the loader reorders rows, a fused projection's parts stacked."""
    if not lanes_here():
        pytest.skip("the lanes layout needs AVX-512 VNNI")
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    from kettle.quantization.q6 import Q6Linear
    from kettle.tensors.gguf_file import Blocks

    n, k = 96, 768
    parts = [random_q6_k_blocks(n, k, seed) for seed in (6, 7)]
    files = [torch.from_numpy(dequantize(data, T.Q6_K)).float() for data in parts]
    order = torch.randperm(n)
    blocks = [Blocks(parts[0], T.Q6_K, n, k, order), Blocks(parts[1], T.Q6_K, n, k, None)]
    fused = Q6Linear.from_blocks(blocks, torch.randn(2 * n))
    dense = torch.cat([files[0][order], files[1]])
    assert sum(t.numel() * t.element_size() for t in fused.buffers()) == 2 * n * k * 210 // 256
    assert torch.equal(fused.dequantized(), dense)
    x = torch.randn(5, k)
    assert relative(fused(x), F.linear(int8_rows(x, int8_span(fused.describe())), dense, fused.bias)) < INT8_RTOL


def test_the_kernels_pack_gguf_blocks_as_the_tensor_ops_lay_them_out():
    """Q4_K, Q6_K, Q4_0, Q4_1 and Q8_0 tensors packed at load by gguf_pack.c (one pass over the file's bytes, 16
    channels a unit of work) hold the bytes the tensor-op layouts define (q4.py `to_lanes` over `int4_groups`, q6.py
    `to_lanes` over `decode_blocks`, q8.py `to_lanes`), for a fused projection's parts stacked with a row order of their
    own; and a type the kernels do not pack from is refused by name."""
    if not lanes_here():
        pytest.skip("the lanes layout needs AVX-512 VNNI")
    from gguf import GGMLQuantizationType as T

    from kettle.quantization import q6
    from kettle.quantization.gguf_blocks import int4_groups
    from kettle.quantization.gguf_scheme import _concat, int4_linear
    from kettle.tensors.gguf_file import Blocks

    n, k = 48, 512
    order = torch.randperm(n)
    q4k = [Blocks(random_q4_k_blocks(n, k, seed), T.Q4_K, n, k, o) for seed, o in ((1, order), (2, None))]
    packed = Q4Linear.from_blocks(q4k)
    moved = int4_linear(_concat([int4_groups(b) for b in q4k]), None)
    for name in ("packed", "scales", "mins", "supers"):
        assert torch.equal(getattr(packed, name), getattr(moved, name)), name
    q6k = [Blocks(random_q6_k_blocks(n, k, seed), T.Q6_K, n, k, o) for seed, o in ((3, None), (4, order))]
    fast = q6.Q6Linear.from_blocks(q6k)
    decoded = [q6.decode_blocks(b.data, n, k) for b in q6k]
    decoded[1] = tuple(t[order] for t in decoded[1])
    slow = q6.Q6Linear(*(torch.cat(parts) for parts in zip(*decoded, strict=True)))
    for name in ("weight_bytes", "scales", "d"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name
    with pytest.raises(ValueError, match="no packer from GGUF type 14 into a q4_lanes weight"):
        ops.pack(packed.rows_of(0, 16), int(T.Q6_K), q6k[0].data)
    from gguf.quants import quantize

    from kettle.quantization.q8 import Q8Linear

    rng = np.random.default_rng(5)
    for qtype in (T.Q4_0, T.Q4_1, T.Q8_0):
        parts = [
            Blocks(quantize(rng.standard_normal((n, k), dtype=np.float32), qtype), qtype, n, k, o)
            for o in (order, None)
        ]
        if qtype == T.Q8_0:
            fast, slow = (
                Q8Linear.from_packed_blocks(parts),
                Q8Linear.concat([Q8Linear.from_blocks(b) for b in parts], None),
            )
            names = ("q", "scales")
        else:
            fast, slow = Q4Linear.from_blocks(parts), int4_linear(_concat([int4_groups(b) for b in parts]), None)
            names = ("packed", "scales", "mins")
            assert (fast.mins is None) == (qtype == T.Q4_0)
        for name in names:
            a, b = getattr(fast, name), getattr(slow, name)
            assert (a is None and b is None) or torch.equal(a, b), (qtype, name)


def test_a_q8_0_weight_in_lanes_holds_the_files_values_and_computes_its_products(monkeypatch):
    """GGUF's Q8_0 in lanes: the same dequantized values, table rows and fused parts as in rows, the layout
    round-trips, and every path's outputs match the rows layout's."""
    if not lanes_here():
        pytest.skip("the lanes layout needs AVX-512 VNNI")
    from kettle.quantization import q8
    from kettle.quantization.q8 import Q8Linear

    monkeypatch.setenv("KETTLE_TUNING", "batch-invariant=off")
    torch.manual_seed(4)
    n, k = 96, 576
    q, scales = torch.randint(-127, 128, (n, k), dtype=torch.int8), (torch.rand(n, k // 32) * 0.01 + 1e-3).half()
    lanes = Q8Linear(q, scales, torch.randn(n))
    rows = with_lanes(False, lambda: Q8Linear(q, scales, lanes.bias.data))
    assert lanes.lanes and not rows.lanes
    assert all(torch.equal(a, b) for a, b in zip(q8.from_lanes(lanes.q, lanes.scales), (q, scales), strict=True))
    assert torch.equal(lanes.dequantized(), rows.dequantized())
    assert torch.equal(Q8Linear.concat([lanes, lanes], None).dequantized(), torch.cat([rows.dequantized()] * 2))
    ids = torch.tensor([0, 95, 17, 16, 15])
    assert torch.equal(lanes.embed(ids), rows.embed(ids))
    assert_lanes_products(lanes, rows)


def test_an_asymmetric_q4_weight_keeps_its_minimums():
    q = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    scales = torch.full((8, 2), 0.01)
    layer = Q4Linear.from_groups(pack_q4(q), scales, -7.5 * scales, 32)
    assert layer.mins is not None and torch.equal(layer.mins, (-7.5 * scales).half())


# Head sizes: 64 and 128 take the unrolled paths; 32 and 80 (64 + a remainder) the general one. Each sequence's
# context is cut into pieces attended apart (kernels.h `context_parts`: 2 a thread, 32 keys at least): on 4 threads
# 4 pieces of 130 keys, 8 of 1,000, of 700 and of 600, and 8 of a 700-key window; 1 of 40.
@pytest.mark.parametrize("dim", [32, 64, 80, 128])
@pytest.mark.parametrize(
    ("lens", "window"),
    [([5, 40, 130, 17], None), ([100, 50, 7], 32), ([1], None), ([1000], None), ([700, 600], None), ([1500], 700)],
)
def test_paged_decode_matches_sdpa_over_scattered_blocks(monkeypatch, lens, window, dim):
    with torch_threads(4):
        check_paged_decode(monkeypatch, lens, window, dim)


def check_paged_decode(monkeypatch, lens, window, dim):
    torch.manual_seed(len(lens))
    block_size, heads, kv_heads = 16, 6, 2
    blocks = sum(-(-n // block_size) for n in lens) + 3
    order = torch.randperm(blocks).tolist()
    tables, used = [], 0
    for n in lens:
        tables.append(order[used : used + -(-n // block_size)])
        used += len(tables[-1])
    k_cache, v_cache = torch.randn(2, blocks * block_size, kv_heads, dim).unbind(0)
    meta = AttentionMetadata.build([1] * len(lens), [n - 1 for n in lens], tables, block_size, "cpu")
    q = torch.randn(len(lens), heads, dim)
    got = SdpaBackend.decode(q, k_cache, v_cache, meta.decode, block_size, dim**-0.5, window)
    monkeypatch.setattr(ops, "available", lambda: False)  # the SDPA path over gathered blocks
    expected = SdpaBackend.decode(q, k_cache, v_cache, meta.decode, block_size, dim**-0.5, window)
    assert relative(got, expected) < 1e-5


# Query heads per KV head: the kernel takes a group's heads up to 4 at a time (1, 2, 3 or 4: each K/V row widened once
# for them), so 5, 7 and 8 are a 4 and a remainder. 37 and 200 keys: tiles of 8 keys and leftovers, whole and cut.
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 96])
def test_a_gqa_groups_heads_get_each_heads_own_bits(group, dtype, dim):
    torch.manual_seed(group)
    block_size, kv_heads, lens = 16, 2, [37, 200]
    blocks = sum(-(-n // block_size) for n in lens) + 2
    order = torch.randperm(blocks).tolist()
    tables = [order[:3], order[3 : 3 + 13]]
    k_cache, v_cache = torch.randn(2, blocks * block_size, kv_heads, dim).to(dtype).unbind(0)
    q = torch.randn(len(lens), kv_heads * group, dim)
    meta = AttentionMetadata.build([1] * len(lens), [n - 1 for n in lens], tables, block_size, "cpu").decode
    table, positions = meta.block_ids.view(len(lens), -1), meta.query_positions.view(-1)
    with torch_threads(2):
        got = ops.paged_decode(q, k_cache, v_cache, table, positions, block_size, dim**-0.5, None)
        # Each query head alone, over its KV head's rows copied out (one head per KV head: no sharing)
        alone = torch.stack(
            [
                ops.paged_decode(
                    q[:, h : h + 1].contiguous(), k_cache[:, h // group : h // group + 1].contiguous(),
                    v_cache[:, h // group : h // group + 1].contiguous(), table, positions, block_size, dim**-0.5, None,
                )[:, 0]
                for h in range(kv_heads * group)
            ],
            dim=1,
        )  # fmt: skip
    assert torch.equal(got, alone)
    for s, n in enumerate(lens):  # and the attention itself, in float64 over the cache's values
        slots = torch.tensor([b * block_size + i for b in tables[s] for i in range(block_size)][:n])
        k, v = (c[slots].double().repeat_interleave(group, dim=1) for c in (k_cache, v_cache))
        weights = torch.softmax(torch.einsum("hd,thd->ht", q[s].double(), k) * dim**-0.5, dim=-1)
        assert relative(got[s].double(), torch.einsum("ht,thd->hd", weights, v)) < 1e-5


@pytest.mark.parametrize("rows", [1, 300])  # 300 × 576 elements: the parallel path
def test_rms_norm_with_and_without_the_residual_add(rows):
    x, residual, weight = torch.randn(rows, 576), torch.randn(rows, 576), torch.rand(576)
    out, total = ops.rms_norm(x, None, weight, 1e-5)
    assert total is None and relative(out, F.rms_norm(x, (576,), weight, 1e-5)) < 1e-5
    out, total = ops.rms_norm(x, residual, weight, 1e-5)
    assert torch.allclose(total, x + residual)
    assert relative(out, F.rms_norm(x + residual, (576,), weight, 1e-5)) < 1e-5


def test_silu_mul_matches_torch():
    gate_up = torch.randn(3, 2 * 100) * 8  # wide range: the vector exp's clamps and tails
    gate, up = gate_up.chunk(2, dim=-1)
    assert relative(ops.silu_mul(gate_up), F.silu(gate) * up) < 1e-5


def test_gelu_tanh_mul_matches_torch():
    gate_up = torch.randn(3, 2 * 100) * 8  # wide range: large |u| saturates tanh, the tail runs in scalars
    gate, up = gate_up.chunk(2, dim=-1)
    assert relative(ops.gelu_tanh_mul(gate_up), F.gelu(gate, approximate="tanh") * up) < 1e-5


def test_rope_reads_a_view_of_the_fused_qkv_output():
    qkv = torch.randn(5, 6 + 2, 64)
    x = qkv[:, :6]  # rows 8 heads apart: not contiguous
    angles = torch.rand(5, 1, 32) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)
    assert ops.rope_fits(x, cos, sin)
    expected = (x * cos).addcmul_(x.roll(32, dims=-1), sin)
    assert relative(RotaryEmbedding.apply(x, cos, sin), expected) < 1e-6


def test_q4_dequantize_matches_the_tensor_op_path(monkeypatch):
    layer = Q4Linear.from_weight(torch.randn(40, 192) * 0.05, group_size=64)
    fast = layer.dequantized()
    monkeypatch.setattr(ops, "available", lambda: False)  # the tensor-op path
    assert torch.allclose(fast, layer.dequantized(), rtol=1e-6, atol=1e-7)  # fma vs mul + add: last bit


@pytest.mark.parametrize("rows, vocab", [(1, 49152), (5, 1000), (3, 37), (2, 7)])
def test_greedy_is_argmax_and_its_log_softmax(rows, vocab):
    """Vocabularies of whole 32-float steps, 8-float steps and a tail, and shorter than one vector."""
    scores = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 5
    ids, logprobs = ops.greedy(scores)
    assert torch.equal(ids, scores.argmax(dim=-1))
    exact = torch.log_softmax(scores.double(), dim=-1).gather(1, ids[:, None])[:, 0]
    torch.testing.assert_close(logprobs.double(), exact, rtol=0, atol=5e-6)


def test_greedy_takes_the_first_of_tied_maxima_and_ignores_minus_infinity():
    scores = torch.full((3, 100), -math.inf)
    scores[0, [7, 50, 99]] = 1.0  # tied in different vector lanes
    scores[1, [3, 11]] = 0.0  # tied in the same lane
    scores[2, 98] = 2.0  # only in the scalar tail
    ids, logprobs = ops.greedy(scores)
    assert ids.tolist() == [7, 3, 98]
    torch.testing.assert_close(logprobs, torch.tensor([-math.log(3), -math.log(2), 0.0]))


def test_greedy_reads_rows_of_a_padded_vocabulary():
    padded = torch.randn(4, 70)
    padded[:, 64:] = 100.0  # past the vocabulary: never read
    ids, logprobs = ops.greedy(padded[:, :64])
    assert torch.equal(ids, padded[:, :64].argmax(dim=-1))
    torch.testing.assert_close(logprobs, torch.log_softmax(padded[:, :64], dim=-1).max(dim=-1).values)


def test_a_source_that_does_not_compile_leaves_pytorch_s_ops_and_no_folder(tmp_path, monkeypatch, caplog):
    """The sources compile side by side; one failing (the others still running or done) is one warning, no kernels
    and no half-built folder, whatever order the compilers finish in."""
    compiler = tmp_path / "cc"  # fails on one source; "compiles" the others by writing their outputs empty
    compiler.write_text(
        '#!/bin/sh\ncase "$*" in *decoder_step.c*) echo "decoder_step.c: error: boom" >&2; exit 1;; esac\n'
        'while [ $# -gt 0 ]; do if [ "$1" = -o ]; then : > "$2"; fi; shift; done\n'
    )
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("KETTLE_CACHE", str(tmp_path / "cache"))
    with caplog.at_level("WARNING"):
        assert build.built_folder() is None
    assert "CPU kernels failed to build" in caplog.text
    assert list((tmp_path / "cache" / "kernels").iterdir()) == []


def _fake_compiler(tmp_path):
    """A "compiler" that writes every output it is asked for, empty, and logs each call."""
    compiler = tmp_path / "cc"
    compiler.write_text(
        f'#!/bin/sh\necho "$*" >> {tmp_path}/calls\n'
        'while [ $# -gt 0 ]; do if [ "$1" = -o ]; then : > "$2"; fi; shift; done\n'
    )
    compiler.chmod(0o755)
    return compiler


@pytest.mark.skipif(settings.current().emulate_avx512, reason="the emulated build is never the installed one")
def test_kernels_built_at_install_serve_a_first_start_with_an_empty_cache(tmp_path, monkeypatch):
    """`python -m kettle.kernels.build` (the install's step) builds into the environment, replacing older keys'
    builds; a server whose cache is empty then loads that build instead of compiling, unless
    KETTLE_INSTALLED_KERNELS=0 asks for the cache's own."""
    monkeypatch.setenv("CC", str(_fake_compiler(tmp_path)))
    monkeypatch.setenv("KETTLE_CACHE", str(tmp_path / "cache"))
    installed = tmp_path / "env" / "share" / "kettle" / "kernels"
    (installed / "cpu-0ld").mkdir(parents=True)
    monkeypatch.setattr(build, "INSTALLED", installed)
    folder = build.install()
    assert folder is not None and folder.parent == installed and (folder / build.LIBRARY).is_file()
    assert [path.name for path in installed.iterdir() if not path.name.startswith(".")] == [folder.name]
    compiles = (tmp_path / "calls").read_text().count(" -o ")  # not the key's `--version`
    assert compiles == len(build.SOURCES) + 1  # each source, then the link
    assert build.built_folder() == folder
    assert (tmp_path / "calls").read_text().count(" -o ") == compiles  # nothing compiled for the server
    assert not (tmp_path / "cache" / "kernels").exists()
    monkeypatch.setenv("KETTLE_TUNING", "installed-kernels=off")
    assert build.built_folder() == tmp_path / "cache" / "kernels" / folder.name


@pytest.mark.parametrize("symmetric", [False, True], ids=["minimums", "symmetric"])
def test_table_rows_are_the_dequantized_weights_rows(symmetric):
    """An embedding lookup from a quantized table (a GGUF file's Q4 or Q8_0 vocabulary) gives exactly the rows the
    projections multiply by, and an id past the table fails as PyTorch's embedding does, reading nothing."""
    torch.manual_seed(0)
    n, k = 40, 128
    scales = torch.rand(n, k // 32) * 0.1
    mins = -8 * scales if symmetric else -torch.rand(n, k // 32)
    table = Q4Linear.from_groups(pack_q4(torch.randint(0, 16, (n, k))), scales, mins, 32)
    assert (table.mins is None) == symmetric
    ids = torch.tensor([[3, 39, 0], [3, 17, 22]])
    torch.testing.assert_close(table.embed(ids), table.dequantized()[ids], atol=0, rtol=0)
    q, q_scales = torch.randint(-127, 128, (n, k), dtype=torch.int8), (torch.rand(n, k // 32) * 0.01).half()
    dense = (q.float().view(n, -1, 32) * q_scales.float()[..., None]).view(n, k)
    q8_table = Q8Linear(q, q_scales)
    torch.testing.assert_close(q8_table.embed(ids), dense[ids], atol=0, rtol=0)
    for bad in (torch.tensor([n]), torch.tensor([-1])):
        with pytest.raises(IndexError, match=r"token ids must be in \[0, 40\)"):
            table.embed(bad)
        with pytest.raises(IndexError):
            q8_table.embed(bad)
