"""Per-channel int8 weight-only linear layers: PyTorch's `_weight_int8pack_mm` on the CPU, Triton on CUDA.

Each output channel keeps one float32 scale (absmax / 127, symmetric); the kernel reads a byte per weight
(a quarter of float32); its fast path takes bfloat16 activations (cast per call; kettle/quantization/config.py).
Large prefills can use a dense float32 GEMM on the
weight dequantized for that call when `dense_rows` says so (measured by `python -m bench decode --vs kernels`).

On CUDA, PyTorch's `_weight_int8pack_mm` is a naive one-thread-per-output kernel on float32 activations, so
decode-sized calls use the Triton GEMV of `kettle.quantization.fp8` instead (it widens int8 to bf16 in
registers exactly as it widens fp8), and larger calls a bf16 GEMM on the weight dequantized for the call.

An int8 [vocab, hidden] LM head quantized per output channel is also a per-row quantized embedding table:
`embed` gathers rows of it, so a tied embedding needs no float copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kettle.kernels import ops
from kettle.kernels.structs import LINEAR_Q8, Linear
from kettle.quantization.config import DENSE_ROWS, INT8_GEMV_ROWS, KERNEL_ACT_DTYPE
from kettle.quantization.kernel_weight import KernelWeight, pointer
from kettle.tensors import huge_pages


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] → (q int8 [N, K], scale float32 [N]) with weight ≈ q · scale[:, None]."""
    weight = weight.float()
    scale = weight.abs().amax(dim=1).clamp(min=1e-10) / 127
    q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class Int8Linear(KernelWeight):
    """y = x Wᵀ (+ b) with W [out, in] int8 and one scale per output channel; same call shape as `Linear`."""

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        act_dtype: torch.dtype = KERNEL_ACT_DTYPE,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = (int(d) for d in q.shape)
        self.dense_rows = DENSE_ROWS
        self.act_dtype = act_dtype
        # On the CPU in 2 MiB pages, as the packed types' are: a decode step streams the weight whole.
        self.register_buffer("q", q if q.is_cuda else huge_pages.placed(q), persistent=False)
        self.register_buffer("scale", scale.float(), persistent=False)
        # The kernel wants the scales in the activations' dtype.
        self.register_buffer("kernel_scale", scale.to(act_dtype), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.on_cuda = q.is_cuda
        self.gemv_rows = INT8_GEMV_ROWS
        # Kettle's CPU kernel takes float32 activations (no bfloat16 casts); KETTLE_TUNING=cpu-kernels=off: not it.
        self.cpu_kernel = not q.is_cuda and self.in_features % 16 == 0 and ops.available()

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, **kwargs) -> Int8Linear:
        """Quantizes a dense [out, in] weight per output channel."""
        return cls(*quantize_int8(weight), bias, **kwargs)

    def dequantized(self) -> torch.Tensor:
        """W as a dense float32 [out, in] tensor."""
        return self.q.float() * self.scale[:, None]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W in float32: the embedding lookup of a tied, int8-quantized table."""
        return self.q[ids].float() * self.scale[ids, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_cuda:
            return self._cuda_forward(x)
        if self.cpu_kernel:  # prompt chunks too: the panel GEMM never dequantizes the whole weight (linear.c)
            return self.kernel_forward(x)
        rows = x.reshape(-1, self.in_features)
        # PyTorch's int8 pack kernel reads K in steps of 16 and crashes (SIGSEGV, torch 2.13 on AVX-512) on
        # any other K: such projections take the dense path.
        if rows.shape[0] > self.dense_rows or self.in_features % 16:
            y = F.linear(rows.float(), self.dequantized())
        else:
            y = torch.ops.aten._weight_int8pack_mm(rows.to(self.act_dtype), self.q, self.kernel_scale)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def describe(self) -> Linear:
        tensors = (self.q, self.scale, None, self.bias)
        return Linear(LINEAR_Q8, self.in_features, self.out_features, self.in_features, *map(pointer, tensors))

    def _cuda_forward(self, x: torch.Tensor) -> torch.Tensor:
        from kettle.quantization.fp8 import fp8_gemv, triton

        rows = x.reshape(-1, self.in_features)
        # tl.dot would round float32 activations to tf32: a float32 model takes the dense path.
        if triton is not None and rows.shape[0] <= self.gemv_rows and rows.dtype in (torch.bfloat16, torch.float16):
            y = fp8_gemv(rows, self.q, self.scale)
        else:
            y = F.linear(rows, self.q.to(rows.dtype) * self.scale.to(rows.dtype)[:, None])
        if self.bias is not None:
            y = (y + self.bias).to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}"


class Int8Embedding(nn.Module):
    """An embedding table kept in int8 with one scale per row; `forward(ids)` returns float32 rows."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        q, scale = quantize_int8(weight)
        self.register_buffer("q", q, persistent=False)
        self.register_buffer("scale", scale, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.q[ids].float() * self.scale[ids, None]
