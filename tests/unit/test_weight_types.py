"""The CPU kernels' weight-type table (kettle/kernels/weight_types.c) as one matrix: every weight type × row count ×
path, each case against the weight's dense values (gguf's own dequantization for the GGUF types); the path chooser's
picks (linear.c); and the Python description of the C structs and enums (kettle/kernels/structs.py) held to
kernels.h."""

from __future__ import annotations

import ctypes
import re
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.quants import dequantize as gguf_dequantize

from kettle import settings
from kettle.kernels import decoder_step, ops, structs
from tests.fixtures import kernel_switch, kernels_buildable
from tests.kernel_weights import (
    INT8_RTOL,
    LANES_NAMES,
    NAMES,
    Weight,
    build,
    int8_reads,
    int8_rows,
    int8_span,
    lanes_here,
)

pytestmark = pytest.mark.skipif(not kernels_buildable(), reason="needs gcc, an AVX2/FMA/F16C CPU and the kernels on")
KERNELS = Path(ops.__file__).parent
# int16 activations (per block of 32, absmax scaling): measured ≤ 6e-5 of the largest output on random data.
INT16_RTOL = 2e-4
FLOAT32_RTOL = 1e-5
INT16_PATHS = {"quantized", "invariant"}
# int8 activations (the lanes kernels, the integer panels) give the dense weights times the int8-rounded rows to
# INT8_RTOL (minimum terms included); the rounding itself moves random rows' outputs by ~0.6% of the largest.
INT8_ROUNDING = 2e-2
# The paths each kind of type has no kernel for: the rows layouts' one-pass float32 kernels are Q4's and Q8's only,
# a row as alone is the rows layouts' (lanes are that already), float32 weights multiply float32 rows only.
MISSING = {
    "q8_0": {"plain"},
    "f32": {"plain", "quantized", "invariant", "int_gemm"},
    **{name: {"plain", "invariant"} for name in LANES_NAMES},
}
# 80 output channels: short last panels of every kernel (16, 24 and 32 channels, tiles of 3 and 12); 512 inputs: two
# Q4_K/Q6_K super-blocks; the row counts cross every kernel's tile (1, 4, 8 rows a pass), the row panels (256 rows).
N, K = 80, 512
ROWS = (1, 3, 5, 9, 17, 300)
_built: dict[str, Weight] = {}


def weight(name: str) -> Weight:
    if name in LANES_NAMES and not lanes_here():
        pytest.skip("the lanes layouts need AVX-512 VNNI")
    if name not in _built:
        _built[name] = build(name, N, K)
    return _built[name]


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("name", NAMES + LANES_NAMES)
def test_each_type_dequantizes_to_its_reference_values(name):
    """The table's `dequantize`: every row, and rows picked by id (an embedding lookup), exactly the reference."""
    w = weight(name)
    assert ops.weight_type(w.linear) == ("q4_lanes" if name.startswith("stacked") else name.split()[0])
    assert torch.equal(ops.dequantize(w.linear), w.dense)
    ids = torch.tensor([N - 1, 0, 17, 16])
    assert torch.equal(ops.dequantize(w.linear, ids), w.dense[ids])
    with pytest.raises(IndexError, match=rf"token ids must be in \[0, {N}\)"):
        ops.dequantize(w.linear, torch.tensor([N]))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("path", structs.PATHS)
@pytest.mark.parametrize("name", NAMES + LANES_NAMES)
def test_every_type_on_every_path_multiplies_by_its_dense_values(name, path, rows):
    w = weight(name)
    if path == "int_gemm" and not lanes_here():
        pytest.skip("the integer panels need AVX-512 VNNI or the lanes types' AVX2 ones")
    x = torch.randn(rows, K)
    # the integer panels run the rows layouts with AVX-512 VNNI only; on an AVX2 CPU, the lanes types alone
    avx2_only = set() if ops.vnni() or name in LANES_NAMES else {"int_gemm"}
    if path in MISSING.get(name, set()) | avx2_only:
        with pytest.raises(ValueError, match=f"has no {path} path"):
            ops.linear_on(x, w.linear, path)
        return
    got = ops.linear_on(x, w.linear, path)
    if int8_reads(w.linear, path):
        assert relative(got, F.linear(int8_rows(x, int8_span(w.linear)), w.dense, w.bias)) < INT8_RTOL
        assert relative(got, F.linear(x, w.dense, w.bias)) < INT8_ROUNDING
        return
    bound = INT16_RTOL if path in INT16_PATHS else FLOAT32_RTOL
    assert relative(got, F.linear(x, w.dense, w.bias)) < bound


@pytest.mark.parametrize("name", [name for name in NAMES + LANES_NAMES if name != "f32"])
def test_a_row_has_the_same_bits_whatever_else_shares_its_call(name):
    """Batch invariance, by type: the paths the chooser takes under it for decode rows (a rows layout's `invariant`,
    the row panels from 256 rows among them; a lanes layout's `quantized` and, from 128 rows, its integer panels)
    compute each row as that row alone does."""
    w = weight(name)
    x = torch.randn(300, K)
    alone = "quantized" if ops.in_lanes(w.linear) else "invariant"
    for path in ("quantized", "int_gemm") if ops.in_lanes(w.linear) else ("invariant",):
        for count in (9, 300):
            together = ops.linear_on(x[:count], w.linear, path)
            for r in (0, count // 2, count - 1):
                assert torch.equal(together[r], ops.linear_on(x[r : r + 1], w.linear, alone)[0]), (path, count, r)


# The lanes weights whose types have AVX2 tiles (`structs.AVX2_LANES_TYPES`; the stacked one's parts are Q4L and Q6L).
AVX2_NAMES = [
    name
    for name in LANES_NAMES
    if name.startswith("stacked") or structs.WEIGHT_TYPES.index(name.split()[0]) in structs.AVX2_LANES_TYPES
]


# The AVX2 int8 kernels' dot-product forms (kernels.h `avx2_dot`): `vpmaddubsw` + `vpmaddwd` (plain AVX2), and the
# 256-bit `vpdpbusd` where the CPU has one: AVX-VNNI's VEX encoding, else AVX512-VNNI + VL's EVEX one (an AVX-512
# machine without AVX-VNNI, such as Zen 4, runs its twin: the same operation and source, another encoding).
AVX2_DOTS = ["maddubs", "vnni256"]


def cpu_vnni256() -> int:
    """`kettle_cpu_vnni256`: 0 none, 1 AVX-VNNI (VEX), 2 AVX512-VNNI + VL (EVEX)."""
    return ctypes.c_int.in_dll(ops.library(), "kettle_cpu_vnni256").value


@contextmanager
def avx2_dot(dot: str):
    """The AVX2 int8 kernels in the form `dot` (AVX2_DOTS); a VNNI test is skipped where the CPU has none."""
    if dot == "vnni256" and not cpu_vnni256():
        pytest.skip("no 256-bit vpdpbusd on this CPU")
    with kernel_switch("kettle_avx2_vnni", 0 if dot == "maddubs" else 1):
        yield


@pytest.mark.skipif(settings.current().emulate_avx512, reason="the emulated build takes AVX-512 on any CPU")
def test_the_cpu_reports_its_256_bit_vnni():
    """The library's answer (cpu_kernels.c, cpuid) agrees with the kernel's flags: the VEX form where the CPU has
    AVX-VNNI, else the EVEX one where it has AVX512-VNNI and VL, else none; and the switch at 0 keeps vpmaddubsw."""
    flags = set(re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M).group(1).split())
    expected = 1 if "avx_vnni" in flags else 2 if {"avx512_vnni", "avx512vl"} <= flags else 0
    assert cpu_vnni256() == expected


@pytest.mark.parametrize("dot", AVX2_DOTS)
@pytest.mark.parametrize("name", AVX2_NAMES)
def test_the_avx2_lanes_tiles_compute_the_avx512_tiles_bits(name, dot):
    """The lanes types with AVX2 tiles (lanes_avx2.c: all but Q5L) are held in lanes on any AVX2 CPU: their tiles,
    run here with AVX-512 switched off for them (`kettle_lanes_avx512`), give every row the bits of the AVX-512 tiles
    (the same integer sums, the same float operations lane by lane), at every row count of a pass and beyond, in
    either dot-product form (`vpmaddubsw`, or the 256-bit `vpdpbusd` of AVX-VNNI CPUs)."""
    w = weight(name)
    x = torch.randn(11, K)
    wide = ops.linear_on(x, w.linear, "quantized")
    with avx2_dot(dot), kernel_switch("kettle_lanes_avx512", 0):
        narrow = ops.linear_on(x, w.linear, "quantized")
        for rows in range(1, 11):  # every pass of 1..4 rows, and passes after a whole one
            assert torch.equal(ops.linear_on(x[:rows], w.linear, "quantized"), wide[:rows]), rows
    assert torch.equal(narrow, wide)
    assert relative(narrow, F.linear(int8_rows(x, int8_span(w.linear)), w.dense, w.bias)) < INT8_RTOL


# The lanes types with the integer panels' AVX2 micro-kernel (weight_types.c's `avx2_panels`: those with AVX2 tiles).
AVX2_PANEL_NAMES = [name for name in AVX2_NAMES if not name.startswith("stacked")]


def avx2_weight(name: str) -> Weight:
    """`weight` for a type held in lanes on any AVX2 CPU: built wherever the kernels run, not only with VNNI."""
    if name not in _built:
        _built[name] = build(name, N, K)
    return _built[name]


@contextmanager
def avx2_cpu(dot: str = "maddubs"):
    """The kernels as on a CPU without AVX-512 VNNI: the chooser, the lanes tiles and the integer panels, their
    dot-product step in the form `dot` (AVX2_DOTS: "vnni256" as on a CPU with AVX-VNNI)."""
    with avx2_dot(dot), kernel_switch("kettle_cpu_vnni512", 0), kernel_switch("kettle_lanes_avx512", 0):
        yield


@pytest.mark.parametrize("dot", AVX2_DOTS)
@pytest.mark.parametrize("name", AVX2_PANEL_NAMES)
def test_the_avx2_integer_panels_compute_the_avx2_tiles_bits(name, dot):
    """On an AVX2 CPU the integer panels (gemm.c's AVX2 micro-kernel: Q4L's 0..15 summed over a block, Q8L's and
    IQ4L's int8 by the sign trick) give every row the bits of the AVX2 tiles (the same exact integer block sums, the
    same float operations lane by lane), at every row count from 1 to 40 (one and both halves of a group of 16 lanes,
    a partial last group) over 80 channels (groups of 12 and a short last one of 8), in either dot-product form; those
    bits are the other form's, the dense weight times the int8-rounded rows, and, where the CPU has AVX-512 VNNI, its
    panels' and tiles'."""
    w = avx2_weight(name)
    x = torch.randn(40, K)
    with avx2_cpu("maddubs"):
        reference = ops.linear_on(x, w.linear, "quantized")
    with avx2_cpu(dot):
        tiles = ops.linear_on(x, w.linear, "quantized")
        for rows in range(1, 41):
            assert torch.equal(ops.linear_on(x[:rows], w.linear, "int_gemm"), tiles[:rows]), rows
    assert torch.equal(tiles, reference)
    assert relative(tiles, F.linear(int8_rows(x, int8_span(w.linear)), w.dense, w.bias)) < INT8_RTOL
    if lanes_here():
        assert torch.equal(ops.linear_on(x, w.linear, "int_gemm"), tiles)
        assert torch.equal(ops.linear_on(x, w.linear, "quantized"), tiles)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", AVX2_PANEL_NAMES)
def test_the_avx2_integer_panels_of_a_wide_weight_compute_the_tiles_bits(name, threads):
    """A weight of 1,040 channels on a team of 1 or 2 threads: the AVX2 panels widen 48 channels at a time (gemm.c
    `avx2_panel_channels`: at most 1,040 / (8 · threads) channels, so 48 either way), the last panel 32 (ten calls of
    3 channels and one of 2), and every row still gets the tiles' bits."""
    w = build(name, 1040, K)
    x = torch.randn(20, K)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with avx2_cpu("maddubs"):
            tiles = ops.linear_on(x, w.linear, "quantized")
            for rows in (1, 9, 20):
                assert torch.equal(ops.linear_on(x[:rows], w.linear, "int_gemm"), tiles[:rows]), rows
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", AVX2_PANEL_NAMES)
def test_the_integer_panels_split_over_two_threads_compute_the_tiles_bits(name):
    """A weight of 1,040 channels on a team of 2: 87 AVX-512 panels of 12 channels handed out 4 at a time (the last
    unit 3 panels, its last panel 8 channels), each thread's first half of its share in order and the rest, unit by
    unit, to whichever thread is free (linear.c `team_units`): whoever ran a unit, every row has the tiles' bits, at
    one group of rows and at several."""
    if not lanes_here():
        pytest.skip("needs AVX-512 VNNI (the AVX2 panels' split is the test above)")
    w = build(name, 1040, K)
    x = torch.randn(40, K)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tiles = ops.linear_on(x, w.linear, "quantized")
        for rows in (1, 16, 40):
            assert torch.equal(ops.linear_on(x[:rows], w.linear, "int_gemm"), tiles[:rows]), rows
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dot", AVX2_DOTS)
@pytest.mark.parametrize("name", ["q4_lanes", "q8_0_lanes", "q6_k_lanes"])
def test_the_avx2_integer_panels_sums_are_exact_at_the_extremes(name, dot):
    """The largest products `vpmaddubsw` meets: Q4's 15s against int8 rows of ±127 (a block's int16 pair sums at
    8 · 2 · 15 · 127 = 30,480, below 2^15), Q8_0's -128 and 127 against them (|q| 128 on the unsigned side through
    the sign trick, pairs at 2 · 128 · 127), Q6_K's 0s and 63s (pairs at 2 · 63 · 127, summed a quad at a time): no
    saturation, the dense products exactly (the tiles' too), in either dot-product form."""
    from kettle.quantization.q4 import Q4Linear, pack_q4
    from kettle.quantization.q6 import Q6Linear
    from kettle.quantization.q8 import Q8Linear

    n = 48
    if name == "q6_k_lanes":
        q = torch.where(torch.rand(n, K) < 0.5, 0, 63).to(torch.uint8)
        layer = Q6Linear(q, torch.ones(n, K // 16, dtype=torch.int8), torch.full((n, K // 256), 0.5).half())
        dense = (q.float() - 32) * 0.5
    elif name == "q4_lanes":
        q = torch.full((n, K), 15, dtype=torch.uint8)
        scales = torch.full((n, K // 32), 0.5)
        layer = Q4Linear.from_groups(pack_q4(q), scales, torch.zeros_like(scales), 32, torch.zeros(n))
        dense = torch.full((n, K), 7.5)
    else:
        q = torch.where(torch.rand(n, K) < 0.5, -128, 127).to(torch.int8)
        layer = Q8Linear(q, torch.full((n, K // 32), 0.5).half(), torch.zeros(n))
        dense = q.float() * 0.5
    x = torch.where(torch.rand(20, K) < 0.5, -127.0, 127.0)  # int8 values ±127, each block's scale 1
    w = layer.describe()
    assert ops.in_lanes(w)
    with avx2_cpu(dot):
        panels, tiles = ops.linear_on(x, w, "int_gemm"), ops.linear_on(x, w, "quantized")
    assert torch.equal(panels, tiles)
    assert torch.equal(panels, x @ dense.T)  # every product and sum exact in float32


@pytest.mark.parametrize("dot", AVX2_DOTS)
def test_the_avx2_iq4_xs_sums_are_exact_at_the_grid_ends(dot):
    """IQ4_XS's grid ends (-127 and 113, indices 0 and 15) through the sign trick against int8 rows of ±127: the
    tiles and the integer panels in either dot-product form give the bits of the `vpmaddubsw` tiles, which are the
    dense weight's products to float32's rounding."""
    from gguf import GGMLQuantizationType as T

    from kettle.quantization.iq4 import IQ4Linear
    from kettle.tensors.gguf_file import Blocks
    from tests.kernel_weights import random_iq4_xs_blocks

    n = 48
    data = random_iq4_xs_blocks(n, K, seed=3).reshape(n, K // 256, 136)
    ends = np.random.default_rng(3).choice(np.array([0x00, 0xFF, 0x0F, 0xF0], dtype=np.uint8), (n, K // 256, 128))
    data[..., 8:] = ends  # every index 0 or 15
    data = data.reshape(n, -1)
    layer = IQ4Linear.from_blocks([Blocks(data, T.IQ4_XS, n, K, None)], torch.zeros(n))
    dense = torch.from_numpy(gguf_dequantize(data, T.IQ4_XS)).float()
    x = torch.where(torch.rand(20, K) < 0.5, -127.0, 127.0)
    w = layer.describe()
    assert ops.in_lanes(w)
    with avx2_cpu("maddubs"):
        reference = ops.linear_on(x, w, "quantized")
    with avx2_cpu(dot):
        panels, tiles = ops.linear_on(x, w, "int_gemm"), ops.linear_on(x, w, "quantized")
    assert torch.equal(tiles, reference) and torch.equal(panels, reference)
    assert relative(reference, x @ dense.T) < 1e-5


def test_an_avx2_cpu_takes_the_integer_panels_for_its_lanes_types(tune):
    """Without AVX-512 VNNI the lanes types with AVX2 tiles take the integer panels (AVX2 micro-kernel) from 64 rows,
    decode or prompt rows alike (the same bits as their tiles below), and their tiles below: int8 rows for prompts as
    for decode. `KETTLE_TUNING=integer-gemm=off` keeps the float32 panels for their prompts. The rows layouts have
    no integer panels there (`ops.integer_gemm()` is for every type only with VNNI)."""
    x = torch.randn(64, K)
    with avx2_cpu():
        assert not ops.integer_gemm()
        for name in AVX2_PANEL_NAMES:
            w = avx2_weight(name).linear
            assert ops.integer_gemm(w.kind)
            assert [ops.path(w, rows) for rows in (1, 63, 64, 300)] == ["quantized"] * 2 + ["int_gemm"] * 2
            assert [ops.path(w, rows, prompt=True) for rows in (1, 63, 64)] == ["quantized"] * 2 + ["int_gemm"]
        q4 = weight("q4").linear
        assert ops.path(q4, 300, prompt=True) == "gemm"
        with pytest.raises(ValueError, match="has no int_gemm path"):
            ops.linear_on(x, q4, "int_gemm")
        tune("integer-gemm=off")
        for name in AVX2_PANEL_NAMES:
            w = avx2_weight(name).linear
            assert not ops.integer_gemm(w.kind)
            assert ops.path(w, 300, prompt=True) == "gemm" and ops.path(w, 300) == "quantized"


@pytest.fixture
def tune(monkeypatch):
    """Sets KETTLE_TUNING for the test (the settings follow the environment in tests: tests/conftest.py)."""
    return lambda value: monkeypatch.setenv("KETTLE_TUNING", value)


def test_the_chooser_keeps_a_rows_arithmetic_by_default():
    """Batch invariance on (the default): a rows layout's decode rows each as alone and its prompt rows on the panels,
    a lanes layout on its kernel until the integer panels, float32 weights on the tiles."""
    q4, f32 = weight("q4").linear, weight("f32").linear
    panels = "int_gemm" if ops.integer_gemm() else "gemm"
    assert [ops.path(q4, rows) for rows in (1, 8, 300)] == ["invariant"] * 3
    assert ops.path(q4, 3, prompt=True) == panels
    assert ops.path(f32, 1) == ops.path(f32, 300) == "tiles"
    if lanes_here():
        lanes, first = weight("q4_lanes").linear, 128 if ops.vnni() else 64  # linear.c's (AVX2_)LANES_GEMM_ROWS
        assert [ops.path(lanes, rows) for rows in (1, first - 1, first)] == ["quantized", "quantized", "int_gemm"]
        assert ops.path(lanes, 3, prompt=True) == "quantized"


def test_the_chooser_takes_the_fastest_path_per_row_count_when_told(tune):
    """Batch invariance off: int16 rows below the float32 tiles (int4 from 8 rows, int8 from 32), the panels from 16
    rows (the integer ones from 10), each threshold a tuning key; float32 rows without quantized activations."""
    tune("batch-invariant=off")
    q4, q8 = weight("q4").linear, weight("q8").linear
    integer = ops.integer_gemm()
    assert [ops.path(q4, rows) for rows in (7, 8, 9)] == ["quantized", "tiles", "tiles"]
    assert ops.path(q4, 10) == ("int_gemm" if integer else "tiles")
    assert [ops.path(q8, rows) for rows in (9, 10)] == ["quantized", "int_gemm" if integer else "quantized"]
    assert ops.path(q4, 16) == ("int_gemm" if integer else "gemm")
    tune("batch-invariant=off,integer-gemm=off")
    assert [ops.path(q4, rows) for rows in (7, 8, 15, 16)] == ["quantized", "tiles", "tiles", "gemm"]
    assert [ops.path(q8, rows) for rows in (15, 16)] == ["quantized", "gemm"]
    tune("batch-invariant=off,integer-gemm=off,float-rows=2,gemm-rows=0")
    assert [ops.path(q4, rows) for rows in (1, 2, 500)] == ["quantized", "tiles", "tiles"]
    tune("batch-invariant=off,quantized-activations=off")
    assert ops.path(q4, 1) == "plain" and ops.path(weight("q8_0").linear, 1) == "tiles"


def _c_struct(source: str, name: str) -> list[str]:
    """The field names of `typedef struct { ... } name;` in a C source, in order."""
    body = re.search(r"typedef struct (?:\w+ )?\{([^{}]*)\} " + name + ";", source).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    fields = []
    for declaration in body.split(";"):
        declaration = re.sub(r"\(\*(\w+)\)\(.*", r"\1", declaration.strip(), flags=re.S)  # a function pointer
        for part in declaration.split(","):
            words = re.findall(r"\w+", part)
            if words:
                fields.append(words[-1])
    return fields


def _c_enum(source: str, prefix: str) -> dict[str, int]:
    return {name: int(value) for name, value in re.findall(rf"\b({prefix}\w+) = (-?\d+)", source)}


def test_the_python_description_is_kernels_h():
    """structs.py's ctypes structs name kernels.h's fields in order, decoder_step.py's decoder_step.c's, and the
    type and path numbers are the enums' (the table's rows in weight_types.c name the same types)."""
    header = (KERNELS / "kernels.h").read_text()
    step = (KERNELS / "decoder_step.c").read_text()
    for source, struct in [(header, structs.Linear), (header, structs.Tuning), (header, structs.Attention)]:
        assert _c_struct(source, struct.__name__) == [f[0] for f in struct._fields_], struct.__name__
    for struct in (
        decoder_step.Norm,
        decoder_step.Experts,
        decoder_step.Layer,
        decoder_step.Lora,
        decoder_step.Decoder,
    ):
        assert _c_struct(step, struct.__name__) == [f[0] for f in struct._fields_], struct.__name__
    kinds = _c_enum(header, "LINEAR_")
    assert kinds == {name: getattr(structs, name) for name in kinds}
    table = dict(re.findall(r"\[(LINEAR_\w+)\] = \{\.name = \"(\w+)\"", (KERNELS / "weight_types.c").read_text()))
    assert {structs.WEIGHT_TYPES[kinds[kind]]: kind for kind in table} == {v: k for k, v in table.items()}
    paths = {name: value for name, value in _c_enum(header, "PATH_").items() if name != "PATHS"}
    assert paths == {name: getattr(structs, name) for name in paths}
    assert [structs.PATHS[paths[f"PATH_{p.upper()}"]] for p in structs.PATHS] == list(structs.PATHS)
    rows_ops = _c_enum((KERNELS / "cpu_kernels.c").read_text(), "ROWS_")
    assert rows_ops == {name: getattr(structs, name) for name in rows_ops}
    table_text = (KERNELS / "weight_types.c").read_text()
    rows = dict(re.findall(r"\[(LINEAR_\w+)\] = \{(.*?)\},\n", table_text, re.S))
    assert {kinds[k] for k, row in rows.items() if ".quantized_rows_avx2" in row} == set(structs.AVX2_LANES_TYPES)
    assert {kinds[k] for k, row in rows.items() if ".avx2_panels = 1" in row} == set(structs.AVX2_LANES_TYPES)


@pytest.mark.parametrize(("lanes", "rows"), [("q4_lanes", "q4"), ("q4_lanes g128", "q4 g128"), ("q8_0_lanes", "q8_0")])
def test_the_float32_panels_read_a_weight_in_lanes_as_its_rows_twin(lanes, rows):
    """The float32 panels (prompts on AVX2 CPUs) dequantize a Q4L or Q8L weight straight from its units, 16 channels
    at a time (the table's `panel_group`): the same values as the rows layout's channels, so the same bits."""
    a, b = weight(lanes), weight(rows)
    assert torch.equal(a.dense, b.dense)
    x = torch.randn(40, K)
    assert torch.equal(ops.linear_on(x, a.linear, "gemm"), ops.linear_on(x, b.linear, "gemm"))


# The packer takes a group's 16 channels 1,024 inputs at a time (gguf_pack.c's PACK_BLOCKS), each channel writing
# its bytes of every block into them: rows of 1,280 inputs (5 K-quant super-blocks) and 1,312 (41 blocks of 32) take
# a whole pass and a short one, the boundary inside a row.
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_K", "IQ4_XS", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_rows_longer_than_a_packing_pass_pack_into_the_files_values(qtype):
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    from kettle.quantization.iq4 import IQ4Linear
    from kettle.quantization.q4 import Q4Linear
    from kettle.quantization.q5 import Q5Linear
    from kettle.quantization.q6 import Q6Linear
    from kettle.quantization.q8 import Q8Linear
    from kettle.tensors.gguf_file import Blocks
    from tests.kernel_weights import random_iq4_xs_blocks, random_q4_k_blocks, random_q5_k_blocks, random_q6_k_blocks

    if not lanes_here():
        pytest.skip("the lanes layouts need AVX-512 VNNI")
    n, k = 32, 1280 if qtype in ("Q4_K", "Q6_K", "Q5_K", "IQ4_XS") else 1312
    random = {"Q4_K": random_q4_k_blocks, "Q6_K": random_q6_k_blocks, "Q5_K": random_q5_k_blocks}
    random |= {"IQ4_XS": random_iq4_xs_blocks}
    if qtype in random:
        data = random[qtype](n, k, seed=11)
    else:
        data = quantize(np.random.default_rng(12).standard_normal((n, k), dtype=np.float32), T[qtype])
    build = {"Q4": Q4Linear.from_blocks, "Q6": Q6Linear.from_blocks, "Q5": Q5Linear.from_blocks}
    build |= {"IQ": IQ4Linear.from_blocks, "Q8": Q8Linear.from_packed_blocks}
    layer = build[qtype[:2]]([Blocks(data, T[qtype], n, k, None)], None)
    assert torch.equal(ops.dequantize(layer.describe()), torch.from_numpy(gguf_dequantize(data, T[qtype])).float())
