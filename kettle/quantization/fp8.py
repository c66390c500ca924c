"""fp8 (e4m3) linear layers for Hopper GPUs: weights in 8 bits with one scale per output channel.

Decode at small batch reads every weight once per step, so halving the bytes of the weights is close to
halving the step. Two kernels serve one layer, chosen by the number of rows in the step:

- up to `GEMV_MAX_ROWS` rows (small-batch decode): a Triton kernel that streams the fp8 weights, widens
  them to the activation dtype in registers and multiplies there; activations stay in bf16 (weight-only).
- more rows (prefill, large batches, compute-bound): `torch._scaled_mm` on the fp8 tensor cores, with the
  activations quantized per row on the fly (one Triton pass: row max, then scale and cast).

Without CUDA (tests, CPU servers) the layer computes the same function by dequantizing, slowly.
`quantize_fp8(model)` swaps every `Linear` of a loaded model for an `Fp8Linear`; embeddings and the LM head
stay in the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kettle.layers.linear import Linear
from kettle.layers.triton_support import tl, triton, tuning

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
GEMV_MAX_ROWS = 16  # decode-sized calls; larger ones multiply a bf16 copy of the weight


if triton is not None:

    @triton.autotune(
        configs=tuning(
            ("BLOCK_N", "BLOCK_K"),
            [(16, 256, 4, 4), (32, 256, 4, 4), (16, 512, 4, 3), (32, 512, 8, 3), (64, 256, 4, 4)],
        ),
        key=["N", "K"],
    )
    @triton.jit
    def _gemv_kernel(
        x_ptr, w_ptr, scale_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # Axis 0 walks row blocks, so the programs that share a weight tile run next to each other (L2 hits).
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            x_mask = (rm[:, None] < M) & (kk[None, :] < K)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=x_mask, other=0.0)
            w_mask = (rn[:, None] < N) & (kk[None, :] < K)
            w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + kk[None, :], mask=w_mask, other=0.0)
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        scale = tl.load(scale_ptr + rn, mask=rn < N, other=0.0)
        y = acc * scale[None, :]
        y_mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=y_mask)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        top = tl.maximum(tl.max(amax, 0), 1e-12)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            q = tl.clamp(x * (FP8_MAX / top), -FP8_MAX, FP8_MAX)
            tl.store(q_ptr + row * K + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=k0 + offs < K)
        tl.store(scale_ptr + row, top / FP8_MAX)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (fp8 [M, K], float32 scales [M, 1]) with x ≈ q * scale, one scale per row (absmax)."""
    if triton is not None and x.is_cuda:
        x = x if x.stride(-1) == 1 else x.contiguous()
        q = torch.empty(x.shape, dtype=FP8, device=x.device)
        scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
        _quantize_rows_kernel[(x.shape[0],)](x, q, scale, x.shape[1], x.stride(0), FP8_MAX=FP8_MAX, BLOCK=1024)
        return q, scale
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16/fp16) @ (weight [N, K] * scale [N])ᵀ → [M, N] in x's dtype, for small M (decode).

    The weight may be fp8 or int8 (`kettle.quantization.int8` on CUDA): the kernel widens it to x's dtype in
    registers. Rows go in blocks of 16; M > 16 runs ⌈M/16⌉ programs per weight tile, which read it from L2."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    n, k = weight.shape
    rows = x.shape[0]
    grid = lambda meta: (triton.cdiv(rows, 16), triton.cdiv(n, meta["BLOCK_N"]))  # noqa: E731
    _gemv_kernel[grid](x, weight, scale, y, rows, n, k, x.stride(0), y.stride(0), BLOCK_M=16)
    return y


class Fp8Linear(nn.Module):
    """y = x (W_q · diag(scale))ᵀ (+ b), W_q [out, in] float8_e4m3fn, scale [out] float32."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        out_features, in_features = weight.shape
        self.in_features = int(in_features)
        # cuBLASLt's fp8 GEMM wants both dimensions in multiples of 16.
        self._tensor_cores = out_features % 16 == 0 and in_features % 16 == 0

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @classmethod
    def from_linear(cls, linear: Linear) -> Fp8Linear:
        """Quantizes a dense layer: per output channel, absmax maps to fp8's largest value."""
        # `dense_weight` is [out, in] whatever layout the dense layer keeps its weight in.
        weight = getattr(linear, "dense_weight", linear.weight).detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
        quantized = (weight / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        bias = None if linear.bias is None else linear.bias.data
        return cls(quantized, scale.contiguous(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if not x.is_cuda:
            y = self._dequantized(rows)
        elif triton is not None and rows.shape[0] <= GEMV_MAX_ROWS:
            y = fp8_gemv(rows, self.weight, self.scale)
        elif self._tensor_cores:
            y = self._scaled_mm(rows)
        else:
            y = self._dequantized(rows)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], -1)

    def _scaled_mm(self, rows: torch.Tensor) -> torch.Tensor:
        q, row_scale = quantize_rows(rows)
        # Row-wise scaling produces bf16 only; weight.t() is the column-major operand the GEMM wants.
        y = torch._scaled_mm(
            q,
            self.weight.t(),
            scale_a=row_scale,
            scale_b=self.scale.view(1, -1),
            out_dtype=torch.bfloat16,
            use_fast_accum=True,
        )
        return y.to(rows.dtype)

    def _dequantized(self, rows: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to(rows.dtype) * self.scale.to(rows.dtype)[:, None]
        return F.linear(rows, weight)


def quantize_fp8(model: nn.Module, keep: tuple[str, ...] = ("lm_head",)) -> nn.Module:
    """Replaces every `Linear` in `model` with its fp8 version, in place, except those named in `keep` (the LM
    head: logits are the most precision-sensitive output, and a tied head shares the embedding's storage)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Linear) and name not in keep:
                setattr(module, name, Fp8Linear.from_linear(child))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return model
