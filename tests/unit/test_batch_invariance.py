"""Batch invariance of Kettle's CPU kernels (`KETTLE_TUNING`'s `batch-invariant`, on by default): a row computed among
other rows has the bits it has alone, for every weight type the kernels take, at every row count a step may have (a
decode step of 1..40 sequences, a prompt chunk of hundreds), through every path a row count picks (weight_types.c's
`invariant_rows`, gemm.c's row panels, the lanes kernels and the integer panels, with AVX-512 VNNI and with an AVX2
CPU's kernels, AVX-512 switched off in-process). The same checks
with the switch off find rows that differ: the fast paths change a row's arithmetic with the row count, which is what
the switch is for."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from kettle.kernels import ops
from kettle.kernels.structs import LINEAR_Q6L
from kettle.quantization.int8 import Int8Linear
from kettle.quantization.q4 import Q4Linear, pack_q4
from kettle.quantization.q8 import Q8Linear
from tests.fixtures import add_tuning, kernel_switch, kernels_buildable, torch_threads, vector_width
from tests.kernel_weights import (
    INT8_RTOL,
    int8_reads,
    random_iq4_xs_blocks,
    random_q4_k_blocks,
    random_q6_k_blocks,
    reference,
)
from tests.unit.test_cpu_kernels import QUANTIZED_ACTIVATION_RTOL, relative

pytestmark = pytest.mark.skipif(not kernels_buildable(), reason="needs gcc, an AVX2/FMA/F16C CPU and the kernels on")

# Decode steps of 1..40 rows (the row panels start at 16), and prompt chunks past the lanes' panels (64 rows on AVX2,
# 128 with AVX-512 VNNI).
COUNTS = (*range(1, 41), 70, 130, 203)


def rows_that_differ(layer: torch.nn.Module, k: int, seed: int = 0) -> list[int]:
    """The row counts m at which some row of layer(x[:m]) differs from that row computed alone; each alone row is
    also checked against the dense product (of the int8-rounded rows where the row alone takes int8 rows, else
    within the int16 activations' bound), so that equal garbage fails."""
    torch.manual_seed(seed)
    x = torch.randn(max(COUNTS), k)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(max(COUNTS))])
    int8 = int8_reads(layer.describe(), ops.path(layer.describe(), 1))
    assert relative(alone, reference(layer, x, int8)) < (INT8_RTOL if int8 else QUANTIZED_ACTIVATION_RTOL)
    return [m for m in COUNTS if not torch.equal(layer(x[:m]), alone[:m])]


def q4_layer(n: int, k: int, group: int, symmetric: bool) -> Q4Linear:
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales = (torch.rand(n, k // group) * 0.02 + 1e-3).half().float()
    mins = -8 * scales if symmetric else -(torch.rand(n, k // group) * 0.1)
    return Q4Linear.from_groups(pack_q4(q), scales, mins, group, torch.randn(n))


def q8_0_layer(n: int, k: int) -> Q8Linear:
    q, scales = torch.randint(-127, 128, (n, k), dtype=torch.int8), (torch.rand(n, k // 32) * 0.01 + 1e-3).half()
    return Q8Linear(q, scales, torch.randn(n))


@contextmanager
def avx2_lanes(avx2: bool, vnni: bool = False) -> Iterator[None]:
    """With `avx2`, the kernels as on a CPU without AVX-512 VNNI (the types with AVX2 tiles stay in lanes: their
    AVX2 tiles and AVX2 integer panels), with `vnni` their dot-product step in the 256-bit `vpdpbusd` of a CPU with
    AVX-VNNI (kernels.h `avx2_dot`; skipped where this CPU has none), else `vpmaddubsw`; else as this CPU has them."""
    if not avx2:
        yield
        return
    if vnni and not ctypes.c_int.in_dll(ops.library(), "kettle_cpu_vnni256").value:
        pytest.skip("no 256-bit vpdpbusd on this CPU")
    with (
        kernel_switch("kettle_cpu_vnni512", 0),
        kernel_switch("kettle_lanes_avx512", 0),
        kernel_switch("kettle_avx2_vnni", int(vnni)),
    ):
        yield


@pytest.fixture(params=["rows", "lanes", "lanes (AVX2)", "lanes (AVX2 + VNNI)"])
def layout(request, monkeypatch) -> Iterator[str]:
    """The rows layouts (Q6_K's and the 5-bit types' on an AVX2 CPU, `--quantize int8`'s everywhere), lanes where the
    CPU has AVX-512 VNNI, and lanes on an AVX2 CPU's kernels (AVX-512 off here), with and without AVX-VNNI."""
    if request.param == "lanes" and not ops.vnni():
        pytest.skip("the lanes layout needs AVX-512 VNNI")
    add_tuning(monkeypatch, lanes=request.param != "rows")
    with avx2_lanes(request.param.startswith("lanes (AVX2"), vnni=request.param == "lanes (AVX2 + VNNI)"):
        yield request.param


@pytest.fixture(params=["AVX-512", "AVX2", "AVX2 + VNNI"])
def lanes_width(request) -> Iterator[str]:
    """A lanes type's kernels where the CPU has AVX-512 VNNI, and an AVX2 CPU's (AVX-512 off here), with and without
    AVX-VNNI."""
    if request.param == "AVX-512" and not ops.vnni():
        pytest.skip("no AVX-512 VNNI here")
    with avx2_lanes(request.param != "AVX-512", vnni=request.param == "AVX2 + VNNI"):
        yield request.param


@pytest.fixture(params=["row channels", "row panels"])
def row_panels(request):
    """The rows layouts' two kernels for several rows at every count here: weight_types.c's `invariant_rows` (below
    `kettle_row_gemm_rows`, 256 by default) and gemm.c's row panels (forced from 1 row). Both must give one row's
    bits."""
    with kernel_switch("kettle_row_gemm_rows", 1 << 30 if request.param == "row channels" else 1):
        yield


# 40 channels in rows: a panel of 24 and one of 16, tiles of 3 with a short last one (48 in lanes: 3 groups of 16);
# K of 24 blocks of 32 (int4) and of 19 (int8, Q8_0 in rows: an odd count of blocks, one chain longer).
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True], ids=["minimums", "symmetric"])
def test_int4_rows_are_computed_as_alone(layout, row_panels, group, symmetric):
    lanes = layout != "rows"
    layer = q4_layer(48 if lanes else 40, 768, group, symmetric)
    assert layer.lanes == lanes
    assert rows_that_differ(layer, 768) == []


def test_q4_k_rows_are_computed_as_alone(lanes_width):
    """In lanes (Q4_K keeps its own scales there): the tiles below the integer panels' rows (128 with AVX-512 VNNI,
    64 on AVX2), the panels from there."""
    from gguf import GGMLQuantizationType as T

    from kettle.quantization.gguf_blocks import int4_groups
    from kettle.quantization.gguf_scheme import int4_linear
    from kettle.tensors.gguf_file import Blocks

    layer = int4_linear(int4_groups(Blocks(random_q4_k_blocks(48, 512, seed=5), T.Q4_K, 48, 512, None)), None)
    assert layer.supers is not None
    assert rows_that_differ(layer, 512) == []


def test_q8_0_rows_are_computed_as_alone(layout, row_panels):
    lanes = layout != "rows"
    layer = q8_0_layer(48 if lanes else 40, 576 if lanes else 608)
    assert layer.lanes == lanes
    assert rows_that_differ(layer, layer.in_features) == []


def test_int8_rows_are_computed_as_alone(row_panels):
    layer = Int8Linear.from_weight(torch.randn(40, 608) * 0.05, torch.randn(40))
    assert layer.cpu_kernel
    assert rows_that_differ(layer, 608) == []


def test_iq4_xs_rows_are_computed_as_alone(lanes_width):
    from gguf import GGMLQuantizationType as T

    from kettle.quantization.iq4 import IQ4Linear
    from kettle.tensors.gguf_file import Blocks

    blocks = [Blocks(random_iq4_xs_blocks(48, 512, seed=9), T.IQ4_XS, 48, 512, None)]
    layer = IQ4Linear.from_blocks(blocks, torch.randn(48))
    assert ops.in_lanes(layer.describe())
    assert rows_that_differ(layer, 512) == []


def test_q6_k_rows_are_computed_as_alone():
    if not ops.lanes(LINEAR_Q6L):
        pytest.skip("Q6_K runs on its own kernel in lanes only (the kernels' tiles, AVX-512 or AVX2); elsewhere int8")
    from gguf import GGMLQuantizationType as T

    from kettle.quantization.q6 import Q6Linear
    from kettle.tensors.gguf_file import Blocks

    layer = Q6Linear.from_blocks([Blocks(random_q6_k_blocks(48, 512, seed=6), T.Q6_K, 48, 512, None)], torch.randn(48))
    assert rows_that_differ(layer, 512) == []


@pytest.fixture(params=["float32 panels (AVX2)", "float32 panels (AVX-512)", "integer panels"])
def prompt_gemm(request, monkeypatch):
    """Each prompt GEMM a CPU may run for the rows layouts: gemm.c's float32 panels with either micro-kernel (an
    AVX2 CPU's), its integer panels (AVX-512 VNNI)."""
    if request.param == "integer panels" and not ops.vnni():
        pytest.skip("the integer panels need AVX-512 VNNI")
    add_tuning(monkeypatch, integer_gemm=request.param == "integer panels")
    with vector_width("kettle_gemm_avx512", request.param == "float32 panels (AVX-512)"):
        yield request.param


@pytest.mark.parametrize("kind", ["int4", "q8_0", "int8"])
def test_prompt_rows_are_computed_as_alone_in_any_chunk_and_beside_decode_rows(monkeypatch, prompt_gemm, kind):
    """Inside a model's layers (`ops.row_kinds`) a weight in rows runs prompt rows on the prompt GEMM, at any chunk
    size with a row's own bits (a prompt alone, 23 others beside it, a chunk of 1 token), and decode rows as one row
    alone, also when a step mixes both: each kind's rows keep their bits whatever the step holds."""
    add_tuning(monkeypatch, lanes=False)
    layer = {"int4": lambda: q4_layer(40, 768, 32, symmetric=False), "q8_0": lambda: q8_0_layer(40, 608)}.get(
        kind, lambda: Int8Linear.from_weight(torch.randn(40, 608) * 0.05, torch.randn(40))
    )()
    k = layer.in_features
    x = torch.randn(150, k, generator=torch.Generator().manual_seed(1))

    def step(rows: torch.Tensor, prompt: list[tuple[int, int]]) -> torch.Tensor:
        with ops.row_kinds(rows.shape[0], prompt):
            return layer(rows)

    prompts = torch.cat([step(x[i : i + 1], [(0, 1)]) for i in range(150)])  # each token a chunk of its own
    decodes = torch.cat([layer(x[i : i + 1]) for i in range(150)])  # each a one-row decode step
    assert torch.equal(step(x, [(0, 150)]), prompts)
    assert torch.equal(step(x[:7], [(0, 7)]), prompts[:7])
    # 5 decode rows, then a prompt chunk: each kind one run of rows, computed in place
    runs = step(x, [(5, 150)])
    assert torch.equal(runs[5:], prompts[5:]) and torch.equal(runs[:5], decodes[:5])
    # 3 decode rows, a prompt chunk of 100, 2 decode rows, a chunk of 45: each kind gathered
    mixed = step(x, [(3, 103), (105, 150)])
    decode_rows = [0, 1, 2, 103, 104]
    prompt_rows = [i for i in range(150) if i not in decode_rows]
    assert torch.equal(mixed[prompt_rows], prompts[prompt_rows])
    assert torch.equal(mixed[decode_rows], decodes[decode_rows])
    # A mixture's expert over its share of the rows (kettle/models/mixtral.py): each gathered row keeps its kind.
    share = torch.tensor([1, 5, 103, 120, 149])
    with ops.row_kinds(150, [(3, 103), (105, 150)]), ops.gathered_rows(share):
        assert torch.equal(layer(x[share]), mixed[share])
    int8 = prompt_gemm == "integer panels"
    assert relative(prompts, reference(layer, x, int8)) < (INT8_RTOL if int8 else QUANTIZED_ACTIVATION_RTOL)


def test_rows_are_computed_as_alone_whatever_the_thread_count():
    """The row panels and channels split channels, never a row's sums, between threads."""
    layer = q4_layer(40, 576, 32, symmetric=False)
    with torch_threads(1):
        one = layer(torch.randn(50, 576, generator=torch.Generator().manual_seed(3)))
    with torch_threads(2):
        assert torch.equal(layer(torch.randn(50, 576, generator=torch.Generator().manual_seed(3))), one)


def test_without_the_switch_the_fast_paths_change_a_rows_bits(monkeypatch):
    """`KETTLE_TUNING=batch-invariant=off` keeps the row-count-dependent arithmetic (float32 tiles and panels in rows):
    the test above would fail there, so it can fail."""
    add_tuning(monkeypatch, lanes=False)
    layer = q4_layer(40, 576, 32, symmetric=False)
    add_tuning(monkeypatch, batch_invariant=False)
    assert rows_that_differ(layer, 576) != []


def test_decode_attention_cuts_each_context_as_alone(monkeypatch):
    """A long context is cut into pieces only to give idle threads work; under batch invariance a sequence is cut
    as it would be alone (here 2 pieces on 4 threads), not by how many others share the call (none with 5): its
    output rows are the same bits alone and in the batch. Without the switch they are not."""
    torch.manual_seed(9)
    heads, kv_heads, dim, block = 8, 2, 64, 16
    lens = [700, 40, 523, 9, 300]
    blocks = sum(-(-n // block) for n in lens)
    k_cache, v_cache = torch.randn(blocks * block, kv_heads, dim), torch.randn(blocks * block, kv_heads, dim)
    order, at, tables = torch.randperm(blocks).tolist(), 0, []
    for n in lens:
        tables.append(order[at : at + -(-n // block)])
        at += -(-n // block)
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    positions, q = torch.tensor([n - 1 for n in lens]), torch.randn(len(lens), heads, dim)

    def attend(rows: list[int]) -> torch.Tensor:
        return ops.paged_decode(q[rows], k_cache, v_cache, table[rows], positions[rows], block, 0.125, None)

    with torch_threads(4):
        together = attend(list(range(len(lens))))
        alone = torch.cat([attend([s]) for s in range(len(lens))])
        assert torch.equal(together, alone)
        monkeypatch.setenv("KETTLE_TUNING", "batch-invariant=off")
        assert not torch.equal(attend(list(range(len(lens)))), alone)
