"""Which instruction sets the CPU kernels use: everything the CPU has (the default), or, for measurement, only what
an AVX2 CPU has (`KETTLE_TUNING=cpu-isa=avx2|avx-vnni`).

The library asks the CPU once, at load (cpu_kernels.c), and each AVX-512 path of the kernels then runs where the CPU
has it: the lanes tiles, the integer and float32 panels, the prefill attention. Most CPUs people serve on have no
AVX-512 (laptops, many cloud instances), and their speed is measured on a machine that has it by turning those
paths off here, right after the load: before any weight is laid out, since which types are held in lanes follows
`kettle_cpu_vnni512` (`ops.vnni`). `avx2` is an AVX2 CPU without VNNI (AMD's Zen 3, Intel before Alder Lake):
the AVX2 int8 kernels take `vpmaddubsw`'s form. `avx-vnni` is one with it (Intel's client cores since Alder Lake):
their 256-bit `vpdpbusd`. A row's bits are the same on every choice (the kernels are written to one arithmetic per
row), so only the speed moves.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

CHOICES = ("auto", "avx2", "avx-vnni")
# The library's switches for its AVX-512 paths (-1: the CPU's answer, 0: off).
AVX512_SWITCHES = ("kettle_lanes_avx512", "kettle_gemm_avx512", "kettle_attention_avx512", "kettle_channel_avx512")
AVX2_DOT_MADDUBS = 0  # kernels.h's AVX2_DOT_*: the 256-bit dot product the CPU runs (`kettle_cpu_vnni256`)


def _int(lib: ctypes.CDLL, name: str) -> ctypes.c_int:
    return ctypes.c_int.in_dll(lib, name)


def restrict(lib: ctypes.CDLL, choice: str) -> None:
    """Limits the loaded library to `choice` (CHOICES); raises ValueError for `avx-vnni` on a CPU without any
    256-bit VNNI encoding (the kernels would fault on it)."""
    if choice == "auto":
        return
    if choice == "avx-vnni" and _int(lib, "kettle_cpu_vnni256").value == AVX2_DOT_MADDUBS:
        raise ValueError("KETTLE_TUNING: cpu-isa avx-vnni needs a CPU with AVX-VNNI or AVX-512 VNNI; this one has none")
    _int(lib, "kettle_cpu_vnni512").value = 0
    for name in AVX512_SWITCHES:
        _int(lib, name).value = 0
    _int(lib, "kettle_avx2_vnni").value = int(choice == "avx-vnni")


def describe(lib: ctypes.CDLL) -> str:
    """What the library runs now, for the start-up log and /info: `AVX-512 VNNI`; `AVX2 + VNNI` or `AVX2` (the int8
    kernels' 256-bit dot product); on an AVX-512 CPU without VNNI (Intel's Skylake and Cascade Lake servers), whose
    float32 panels and prefill attention still run at 512 bits, `AVX-512 without VNNI (int8: AVX2)`."""
    if _int(lib, "kettle_cpu_vnni512").value:
        return "AVX-512 VNNI"
    dot = _int(lib, "kettle_cpu_vnni256").value != AVX2_DOT_MADDUBS and _int(lib, "kettle_avx2_vnni").value != 0
    int8 = "AVX2 + VNNI" if dot else "AVX2"
    wide = _int(lib, "kettle_gemm_avx512").value  # -1: where the CPU has AVX-512F
    if wide > 0 or (wide < 0 and "avx512f" in cpu_flags()):
        return f"AVX-512 without VNNI (int8: {int8})"
    return int8


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (/proc/cpuinfo); empty where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
