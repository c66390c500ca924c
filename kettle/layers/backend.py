"""Which implementation an element-wise op runs: Triton (CUDA), Kettle's C kernels (CPU float32) or PyTorch.

An op picks once, from where its tensors live, and keeps the choice: a norm or a rotary table when it is
built (its weight or table is there), an MLP or an attention module on its first call (its input is the first
tensor it sees). The hot path then branches on a stored value instead of re-deriving device, dtype and the
switches on every call. The switches (`KETTLE_TUNING`'s `cuda-fused-kernels` and `cpu-kernels`) are read at
that choice, so changing them affects models loaded afterwards.
"""

from __future__ import annotations

from enum import StrEnum

import torch

from kettle import settings
from kettle.kernels import ops
from kettle.layers import cuda_fused


class Backend(StrEnum):
    """An op's implementation."""

    TRITON = "triton"  # the fused kernels of kettle/layers/cuda_fused.py
    C = "c"  # Kettle's CPU kernels (float32)
    TORCH = "torch"  # PyTorch's ops, anywhere


def choose(tensor: torch.Tensor) -> Backend:
    """The backend for an op whose tensors live where `tensor` does, with its dtype."""
    if tensor.is_cuda:
        fused = cuda_fused.triton is not None and settings.current().cuda_fused_kernels
        return Backend.TRITON if fused else Backend.TORCH
    if tensor.device.type == "cpu" and tensor.dtype == torch.float32 and ops.available():
        return Backend.C
    return Backend.TORCH
