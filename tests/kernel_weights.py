"""One random weight of each of the CPU kernels' weight types (kettle/kernels/weight_types.c), with the dense float32
values it stands for: gguf's own dequantization for the GGUF types, the float weight for float32."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kettle.kernels import ops
from kettle.kernels.structs import LANES_TYPES, LINEAR_F32, LINEAR_IQ4L, LINEAR_Q4L, LINEAR_Q5L, LINEAR_Q6L, Linear


@dataclass
class Weight:
    """A weight's C description, the dense values it must multiply by and its bias; `keep` holds the tensors the
    description points into."""

    linear: Linear
    dense: torch.Tensor
    bias: torch.Tensor
    keep: object


def random_q4_k_blocks(n: int, k: int, seed: int) -> np.ndarray:
    """Q4_K blocks [n, k/256 · 144 bytes] with random nibbles and 6-bit scales, and a d and dmin of its own for each
    super-block (so a super-block read for the wrong one shows)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    for at, top in ((0, 2e-3), (2, 3e-3)):  # d, dmin
        blocks[..., at : at + 2] = (rng.random((n, k // 256, 1)) * top + 1e-4).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def random_q5_k_blocks(n: int, k: int, seed: int) -> np.ndarray:
    """Q5_K blocks [n, k/256 · 176 bytes]: random nibbles, fifth bits and 6-bit scales, a d and dmin of its own for
    each super-block."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // 256, 176), dtype=np.uint8)
    for at, top in ((0, 2e-3), (2, 3e-3)):  # d, dmin
        blocks[..., at : at + 2] = (rng.random((n, k // 256, 1)) * top + 1e-4).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def random_iq4_xs_blocks(n: int, k: int, seed: int) -> np.ndarray:
    """IQ4_XS blocks [n, k/256 · 136 bytes]: random indices and 6-bit scales, a d of its own per super-block."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // 256, 136), dtype=np.uint8)
    blocks[..., 0:2] = (rng.random((n, k // 256, 1)) * 2e-4 + 1e-5).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def random_q6_k_blocks(n: int, k: int, seed: int) -> np.ndarray:
    """Q6_K blocks [n, k/256 · 210 bytes]: random low and high bits and int8 scales, a d of its own per super-block."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // 256, 210), dtype=np.uint8)
    blocks[..., 208:210] = (rng.random((n, k // 256, 1)) * 2e-4 + 1e-5).astype(np.float16).view(np.uint8)
    return blocks.reshape(n, -1)


def with_lanes(on: bool, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """A layer built with the lanes layouts switched on or off (`KETTLE_TUNING=lanes=off`; in tests the settings
    follow the environment: tests/conftest.py), the environment restored."""
    before = os.environ.get("KETTLE_TUNING")
    os.environ["KETTLE_TUNING"] = ",".join(item for item in (before, "" if on else "lanes=off") if item)
    try:
        return build()
    finally:
        if before is None:
            del os.environ["KETTLE_TUNING"]
        else:
            os.environ["KETTLE_TUNING"] = before


def _gguf(data: np.ndarray, qtype) -> torch.Tensor:
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(data, qtype)).float()


def _q4(n: int, k: int, lanes: bool, symmetric: bool) -> tuple[torch.nn.Module, torch.Tensor]:
    """GGUF's Q4_0 (symmetric: w = d · (q - 8)) or Q4_1 (w = d · q + m), groups of 32, scales in float16."""
    from kettle.quantization.q4 import Q4Linear, pack_q4

    scales = (torch.rand(n, k // 32) * 0.1 + 1e-3).half().float()
    mins = -8 * scales if symmetric else (-torch.rand(n, k // 32) * 0.5).half().float()
    q = torch.randint(0, 16, (n, k))
    layer = with_lanes(lanes, lambda: Q4Linear.from_groups(pack_q4(q), scales, mins, 32, torch.randn(n)))
    dense = q.float().view(n, -1, 32) * scales[..., None] + mins[..., None]
    return layer, dense.view(n, k)


def _q4_quantized(n: int, k: int, lanes: bool) -> tuple[torch.nn.Module, torch.Tensor]:
    """`--quantize int4`'s: a float weight quantized in groups of 128, minimums stored."""
    from kettle.quantization.q4 import Q4Linear, unpack_q4

    layer = with_lanes(lanes, lambda: Q4Linear.from_weight(torch.randn(n, k) * 0.05, torch.randn(n), 128))
    packed, scales, mins = layer.stored()
    dense = unpack_q4(packed).float().view(n, -1, 128) * scales.float()[..., None] + mins.float()[..., None]
    return layer, dense.view(n, k)


def _q4_k(n: int, k: int) -> tuple[torch.nn.Module, torch.Tensor]:
    from gguf import GGMLQuantizationType as T

    from kettle.quantization.gguf_blocks import int4_groups
    from kettle.quantization.gguf_scheme import int4_linear
    from kettle.tensors.gguf_file import Blocks

    data = random_q4_k_blocks(n, k, seed=5)
    return int4_linear(int4_groups(Blocks(data, T.Q4_K, n, k, None)), torch.randn(n)), _gguf(data, T.Q4_K)


def _q8_0(n: int, k: int, lanes: bool) -> tuple[torch.nn.Module, torch.Tensor]:
    from kettle.quantization.q8 import Q8Linear

    q, scales = torch.randint(-127, 128, (n, k), dtype=torch.int8), (torch.rand(n, k // 32) * 0.01 + 1e-3).half()
    layer = with_lanes(lanes, lambda: Q8Linear(q, scales, torch.randn(n)))
    return layer, (q.float().view(n, -1, 32) * scales.float()[..., None]).view(n, k)


def _q6_k(n: int, k: int) -> tuple[torch.nn.Module, torch.Tensor]:
    from gguf import GGMLQuantizationType as T

    from kettle.quantization.q6 import Q6Linear
    from kettle.tensors.gguf_file import Blocks

    data = random_q6_k_blocks(n, k, seed=6)
    return Q6Linear.from_blocks([Blocks(data, T.Q6_K, n, k, None)], torch.randn(n)), _gguf(data, T.Q6_K)


def _q5(n: int, k: int, qtype_name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """A Q5_K, Q5_0 or Q5_1 tensor (the legacy types quantized by gguf-py from a random weight)."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    from kettle.quantization.q5 import Q5Linear
    from kettle.tensors.gguf_file import Blocks

    qtype = T[qtype_name]
    if qtype == T.Q5_K:
        data = random_q5_k_blocks(n, k, seed=7)
    else:
        data = quantize(np.random.default_rng(8).standard_normal((n, k), dtype=np.float32) * 0.05, qtype)
    return Q5Linear.from_blocks([Blocks(data, qtype, n, k, None)], torch.randn(n)), _gguf(data, qtype)


def _iq4_xs(n: int, k: int) -> tuple[torch.nn.Module, torch.Tensor]:
    from gguf import GGMLQuantizationType as T

    from kettle.quantization.iq4 import IQ4Linear
    from kettle.tensors.gguf_file import Blocks

    data = random_iq4_xs_blocks(n, k, seed=9)
    return IQ4Linear.from_blocks([Blocks(data, T.IQ4_XS, n, k, None)], torch.randn(n)), _gguf(data, T.IQ4_XS)


def _q8(n: int, k: int) -> tuple[torch.nn.Module, torch.Tensor]:
    from kettle.quantization.int8 import Int8Linear

    layer = Int8Linear.from_weight(torch.randn(n, k), torch.randn(n))
    return layer, layer.q.float() * layer.scale[:, None]


def _f32(n: int, k: int) -> Weight:
    weight, bias = torch.randn(n, k), torch.randn(n)
    linear = Linear(LINEAR_F32, k, n, k, weight.data_ptr(), None, None, bias.data_ptr())
    return Weight(linear, weight, bias, (weight, bias))


# Each type's builder: name → (n, k) → Weight; the lanes types need them on (`lanes_here`).
def build(name: str, n: int, k: int) -> Weight:
    torch.manual_seed(0)
    if name == "f32":
        return _f32(n, k)
    if name in ("q4", "q4 symmetric", "q4_lanes", "q4_lanes symmetric"):
        layer, dense = _q4(n, k, lanes="lanes" in name, symmetric="symmetric" in name)
    elif name in ("q4 g128", "q4_lanes g128"):
        layer, dense = _q4_quantized(n, k, lanes="lanes" in name)
    elif name == "q4_lanes q4_k":
        layer, dense = _q4_k(n, k)
    elif name in ("q8_0", "q8_0_lanes"):
        layer, dense = _q8_0(n, k, lanes=name == "q8_0_lanes")
    elif name == "q6_k_lanes":
        layer, dense = _q6_k(n, k)
    elif name == "iq4_xs_lanes":
        layer, dense = _iq4_xs(n, k)
    elif name.startswith("q5_lanes"):
        layer, dense = _q5(n, k, name.split()[1].upper())
    elif name == "stacked q4_k q6_k":  # a Q4_K_M file's q/k/v with a Q6_K v: two types, one projection
        from kettle.quantization.kernel_weight import StackedWeight

        (first, top), (second, bottom) = _q4_k(n - 32, k), _q6_k(32, k)
        layer, dense = StackedWeight([first, second]), torch.cat([top, bottom])
    else:
        layer, dense = _q8(n, k)
    return Weight(layer.describe(), dense, layer.bias.data, layer)


NAMES = ("q4", "q4 symmetric", "q4 g128", "q8", "q8_0", "f32")
LANES_NAMES = ("q4_lanes", "q4_lanes symmetric", "q4_lanes g128", "q4_lanes q4_k", "q8_0_lanes", "q6_k_lanes")
LANES_NAMES += ("q5_lanes q5_k", "q5_lanes q5_0", "q5_lanes q5_1", "iq4_xs_lanes", "stacked q4_k q6_k")


def lanes_here() -> bool:
    """Whether every lanes type is in lanes here: with AVX-512 VNNI, and on any AVX2 CPU on its AVX2 tiles and panels
    (`structs.AVX2_LANES_TYPES`: every lanes type has them)."""
    return ops.available() and all(ops.lanes(kind) for kind in LANES_TYPES)


def int8_span(weight: Linear) -> int:
    """The inputs per int8 scale of the rows the kernels multiply `weight` by (kernels.h `int8_span`): 256 where a
    part of it holds Q4_K's, Q5_K's, Q6_K's or IQ4_XS's scales in lanes, whose kernels combine a super-block's blocks
    in integers."""
    part = weight
    while True:
        if part.supers and part.kind in (LINEAR_Q4L, LINEAR_Q5L, LINEAR_IQ4L, LINEAR_Q6L):
            return 256
        if not part.next:
            return 32
        part = part.next.contents


def int8_rows(x: torch.Tensor, span: int = 32) -> torch.Tensor:
    """x [rows, K] as the lanes kernels and the integer panels multiply it: each `span` of inputs (`int8_span`)
    rounded to int8 with absmax / 127, the same float operations as kernels.h's `quantize_row` (scale, reciprocal,
    round to even)."""
    blocks = x.float().reshape(x.shape[0], -1, span)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse) * d).reshape(x.shape)


# int8 rows against the dense weights times `int8_rows(x)`: float32 rounding only.
INT8_RTOL = 1e-5


def int8_reads(weight: Linear, path: str) -> bool:
    """Whether `path` multiplies int8 rows for this weight: the integer panels, and a lanes type's own kernels (the
    rows layouts' one-row and invariant paths multiply int16 rows)."""
    return path == "int_gemm" or (path == "quantized" and ops.in_lanes(weight))


def reference(layer: torch.nn.Module, x: torch.Tensor, int8: bool) -> torch.Tensor:
    """layer's dense product for rows x, as the kernels see them: int8-rounded where they multiply int8 rows."""
    rows = int8_rows(x, int8_span(layer.describe())) if int8 else x
    return torch.nn.functional.linear(rows, layer.dequantized(), layer.bias)
