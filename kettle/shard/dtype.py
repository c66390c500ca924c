"""The dtype a shard runs in: `--dtype` when given, else a per-device default informed by the checkpoint.

- CPU: float32. Measured fastest on the CPUs we run on (bf16 matmuls were 5-10x slower on an AVX2 CPU without
  native bf16), so a checkpoint's bf16/fp16 `torch_dtype` is deliberately not followed there.
- CUDA: the checkpoint's `torch_dtype` (`dtype` in transformers 5 configs) when it is float16 or bfloat16,
  else bfloat16 (float32 checkpoints would double the memory and miss the tensor cores).
- `--dtype float16` on the CPU is refused: PyTorch's CPU float16 kernels are slow here and fp16's range
  overflows on checkpoints trained in bf16, for no memory gain over bfloat16, which the error suggests instead.

The KV cache has its own dtype (`choose_kv_dtype`, `--kv-cache-dtype`). On the CPU it may be float16 or bfloat16
under a float32 model: half the bytes per token, so twice the tokens in the same share of RAM; Kettle's attention
kernels widen the rows as they read them. By default (`auto`) a float32 model on the CPU with Kettle's kernels
keeps float16 K/V, as llama.cpp does: measured on the bundled model, a mean next-token KL of 6.2e-7 against a
float32 cache with the same top-1 token everywhere, and decode steps 3-10% faster (docs/performance.md).
Elsewhere `auto` is the model's dtype. On CUDA every `--kv-cache-dtype` applies, TGI's `fp8_e4m3fn` and
`fp8_e5m2` included (half a 16-bit cache's bytes per token; values stored with a scale of 1.0 and saturated at
the format's range, as TGI and vLLM do without calibrated scales). float8 needs compute capability 8.9 or newer
(Ada, Hopper), where Triton converts it in hardware, and is refused on the CPU, which has no float8 kernels.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HALF = (torch.float16, torch.bfloat16)
# `--kv-cache-dtype` values the CPU cache takes (kettle.shard.config.KV_CACHE_DTYPES lists them all).
KV_DTYPES = {"float32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
FP8_DTYPES = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}  # CUDA only


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


def choose_kv_dtype(name: str | None, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype for `--kv-cache-dtype NAME` (None or "auto": see the module docstring)."""
    if name is None or name == "auto":
        from kettle.kernels import ops

        cpu_float32 = device.type == "cpu" and model_dtype == torch.float32
        return torch.float16 if cpu_float32 and ops.available() else model_dtype
    if name in FP8_DTYPES:
        if device.type != "cuda":
            raise ValueError(f"--kv-cache-dtype {name} needs a CUDA GPU: on the CPU use fp16 or bf16")
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            major, minor = capability
            raise ValueError(
                f"--kv-cache-dtype {name} needs a GPU of compute capability 8.9 or newer (Ada, Hopper); this one is "
                f"{major}.{minor}: use the default or fp16/bf16"
            )
        return FP8_DTYPES[name]
    if name not in KV_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of auto, {', '.join(KV_DTYPES)}, fp8_e4m3fn, fp8_e5m2")
    return KV_DTYPES[name]


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
