"""How many bytes of weights one decode step reads: the numerator of achieved bandwidth."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def parameter_count(model_path: Path) -> int:
    """Parameters in the folder's safetensors files (tied weights stored once are counted once)."""
    total = 0
    for file in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                total += _numel(f.get_slice(name).get_shape())
    return total


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def weight_bytes(model_path: Path, dtype: str) -> int:
    """Bytes of weights at the served dtype (every weight is read once per decode step)."""
    return parameter_count(model_path) * _BYTES.get(dtype, 4)
