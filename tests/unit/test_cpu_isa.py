"""`KETTLE_TUNING=cpu-isa` (kettle/kernels/isa.py): the kernel library limited to an AVX2 CPU's instructions as it
loads, in a fresh process as a shard loads it, and refused where the CPU cannot run the choice."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

from kettle import settings
from kettle.kernels import build, isa
from tests.fixtures import kernel_switch

SWITCHES = ("kettle_cpu_vnni512", "kettle_avx2_vnni", *isa.AVX512_SWITCHES)
PROBE = """
import ctypes, json, logging
logging.basicConfig(level=logging.INFO, format="%(message)s")
from kettle.kernels import build, isa
lib = build.library()
print(json.dumps({"describe": isa.describe(lib), **{n: ctypes.c_int.in_dll(lib, n).value for n in NAMES}}))
"""


def loaded_as(choice: str) -> tuple[dict, str]:
    """What a process started with `cpu-isa=<choice>` loads: its switches and description, and its log."""
    env = {**os.environ, "KETTLE_TUNING": settings.merge_tuning(os.environ.get("KETTLE_TUNING"), {"cpu-isa": choice})}
    done = subprocess.run(
        [sys.executable, "-c", PROBE.replace("NAMES", repr(SWITCHES))], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


@pytest.fixture
def library():
    lib = build.library()
    if lib is None:
        pytest.skip("the CPU kernels are switched off or not built here")
    return lib


def cpu_has_vnni256(lib) -> bool:
    return ctypes.c_int.in_dll(lib, "kettle_cpu_vnni256").value != isa.AVX2_DOT_MADDUBS


def test_auto_keeps_what_the_cpu_has(library):
    state, log = loaded_as("auto")
    vnni512 = ctypes.c_int.in_dll(library, "kettle_cpu_vnni512").value  # this process: the CPU's own answer
    assert state["kettle_cpu_vnni512"] == vnni512
    assert all(state[name] == -1 for name in isa.AVX512_SWITCHES) and state["kettle_avx2_vnni"] == -1
    expected = "AVX-512 VNNI" if vnni512 else "AVX2 + VNNI" if cpu_has_vnni256(library) else "AVX2"
    assert state["describe"] == expected and f"CPU kernels: {expected}" in log


@pytest.mark.parametrize(("choice", "described", "dot"), [("avx2", "AVX2", 0), ("avx-vnni", "AVX2 + VNNI", 1)])
def test_an_avx2_choice_turns_every_avx512_path_off_at_load(library, choice, described, dot):
    if choice == "avx-vnni" and not cpu_has_vnni256(library):
        pytest.skip("no 256-bit VNNI here")
    state, log = loaded_as(choice)
    assert state["kettle_cpu_vnni512"] == 0 and all(state[name] == 0 for name in isa.AVX512_SWITCHES)
    assert state["kettle_avx2_vnni"] == dot
    assert state["describe"] == described and f"CPU kernels: {described}" in log


def test_avx_vnni_is_refused_where_the_cpu_has_no_vnni_and_nothing_changes(library):
    """Asked on a CPU whose only 256-bit dot product is `vpmaddubsw` (this one, told so), the choice fails with the
    key's name instead of running instructions the CPU lacks, and the library keeps its paths."""
    before = {name: ctypes.c_int.in_dll(library, name).value for name in SWITCHES}
    refused = pytest.raises(ValueError, match="cpu-isa avx-vnni needs a CPU with AVX-VNNI or AVX-512 VNNI")
    with kernel_switch("kettle_cpu_vnni256", isa.AVX2_DOT_MADDUBS), refused:
        isa.restrict(library, "avx-vnni")
    assert {name: ctypes.c_int.in_dll(library, name).value for name in SWITCHES} == before


def test_an_avx512_cpu_without_vnni_is_named_as_such(library):
    """A CPU with AVX-512F but no VNNI (Skylake-SP, this one told so) runs the int8 kernels in AVX2 and the float32
    panels at 512 bits: the description says both, not plain AVX2."""
    with kernel_switch("kettle_cpu_vnni512", 0):
        with kernel_switch("kettle_gemm_avx512", 1):
            assert isa.describe(library).startswith("AVX-512 without VNNI (int8: AVX2")
        with kernel_switch("kettle_gemm_avx512", 0):
            assert isa.describe(library) in ("AVX2", "AVX2 + VNNI")


def test_the_settings_take_exactly_the_choices_the_library_knows():
    """KETTLE_TUNING's cpu-isa values are written out in kettle/settings.py (it imports nothing of Kettle's): they are
    isa.CHOICES, and a name outside them is refused."""
    parse = settings.TUNING["cpu-isa"].parse
    assert [parse(choice) for choice in isa.CHOICES] == list(isa.CHOICES)
    with pytest.raises(ValueError):
        parse("avx512")
