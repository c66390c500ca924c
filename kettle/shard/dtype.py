"""The dtype a shard runs in: `--dtype` when given, else a per-device default informed by the checkpoint.

- CPU: float32. Measured fastest on the CPUs we run on (bf16 matmuls were 5-10x slower on an AVX2 CPU without
  native bf16), so a checkpoint's bf16/fp16 `torch_dtype` is deliberately not followed there.
- CUDA: the checkpoint's `torch_dtype` (`dtype` in transformers 5 configs) when it is float16 or bfloat16,
  else bfloat16 (float32 checkpoints would double the memory and miss the tensor cores).
- `--dtype float16` on the CPU is refused: PyTorch's CPU float16 kernels are slow here and fp16's range
  overflows on checkpoints trained in bf16, for no memory gain over bfloat16, which the error suggests instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HALF = (torch.float16, torch.bfloat16)


def choose_dtype(name: str | None, device: torch.device, model_path: str | Path | None = None) -> torch.dtype:
    """The dtype to load the model in on `device` (see the module docstring for the rules)."""
    if name is not None:
        dtype = DTYPES[name]
        if dtype == torch.float16 and device.type == "cpu":
            raise ValueError("--dtype float16 is not supported on the CPU: use bfloat16 or float32 (the default)")
        return dtype
    if device.type != "cuda":
        return torch.float32
    declared = checkpoint_dtype(model_path) if model_path is not None else None
    return declared if declared in _HALF else torch.bfloat16


def checkpoint_dtype(model_path: str | Path) -> torch.dtype | None:
    """The dtype config.json declares (`dtype`, or the older `torch_dtype`; also in a `text_config`)."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    for settings in (config, config.get("text_config") or {}):
        value = settings.get("dtype") or settings.get("torch_dtype")
        if isinstance(value, str):
            return DTYPES.get(value.removeprefix("torch."))
    return None
