"""How many bytes of weights one decode step reads: the numerator of achieved bandwidth."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Bytes a weight occupies under `--quantize` (int4: a nibble plus a float16 scale and minimum per group of 64);
# the LM head and tied embedding are int8 under both (KETTLE_QUANT_LM_HEAD's default).
_QUANTIZED_BYTES = {"int8": 1.0, "int4": 0.5 + 4 / 64, "gptq": 0.5 + 4 / 64, "awq": 0.5 + 4 / 64}


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


def weight_bytes(model_path: Path, dtype: str, quantize: str | None = None) -> int:
    """Bytes of weights at the served dtype (every weight is read once per decode step); under `--quantize`
    int8/int4/gptq/awq the 2-D projection weights count at their quantized width, the LM head at int8."""
    if quantize not in _QUANTIZED_BYTES:
        return parameter_count(model_path) * _BYTES.get(dtype, 4)
    total = 0.0
    for file in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                shape = f.get_slice(name).get_shape()
                head = "embed" in name or "lm_head" in name or "wte" in name
                width = 1.0 if head else _QUANTIZED_BYTES[quantize] if len(shape) == 2 else _BYTES.get(dtype, 4)
                total += _numel(shape) * width
    return int(total)
