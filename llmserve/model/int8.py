"""W8A8 INT8 linear layers: weights in int8 with a scale per output channel (symmetric), activations
quantized to int8 per token as they arrive (dynamically, or with a checkpoint's static scale), the
product accumulated in int32.

y = (x_q * s_x) @ (W_q * s_w)^T = (x_q @ W_q^T) * s_x * s_w^T, with x_q = round(x / s_x) and
W_q = round(W / s_w) in [-127, 127] (s = amax / 127 per token, per output row). The integer
product is exact (|sum| <= K * 127^2 stays far inside int32 for any model's K), so every
implementation gives the same int32 accumulator; only the scaling after it rounds:
- `int8_gemm_reference`: the definition in PyTorch: the integer product (computed in float64,
  exact for int32-sized sums, by the CPU's BLAS), converted to float32, times the token's scale
  and then the row's scale, rounded to the output dtype;
- `llmserve/kernels/int8_linear.py`: `torch._int_mm` and a Triton int8 GEMM with the same
  epilogue in the same order (equal to the reference bit for bit: tests/test_int8_kernels.py).
`dequantize_int8` is the weight's float value (W_q * s_w): the float model a W8A8 model
approximates. The LM head, the embedding, norms and biases stay in the model's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.model.tensor_parallel import TPGroup

INT8_MAX = 127  # symmetric: -128 is never used, so W_q and -W_q are both representable
_MIN_SCALE = 1e-12  # an all-zero row or token keeps a finite scale


def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` [rows, cols] in int8 with a float32 scale per row ([rows, 1]), round to nearest even."""
    w = w.to(torch.float32)
    scale = (w.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp(min=_MIN_SCALE)
    return torch.round(w / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale.contiguous()


def quantize_tokens_int8(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [T, K] in int8, dynamically per token (or with a checkpoint's static scale);
    each value times the scale's reciprocal (as the FP8 path quantizes), rounded to nearest even."""
    x = x.to(torch.float32)
    if static_scale is None:
        amax = x.abs().amax(dim=-1, keepdim=True)
        scale = (amax / torch.full_like(amax, INT8_MAX)).clamp(min=_MIN_SCALE)
    else:
        scale = static_scale.to(torch.float32).reshape(1, 1).expand(x.shape[0], 1)
    inv = torch.ones_like(scale) / scale
    return torch.round(x * inv).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale.contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32) * scale


def scale_int32(acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The epilogue every implementation shares: int32 accumulator [M, N] -> float32, times the
    tokens' scales [M, 1], then the rows' scales [N, 1] (in this order), in `out_dtype`."""
    return (acc.to(torch.float32) * sx.reshape(-1, 1) * sw.reshape(1, -1)).to(out_dtype)


def int8_gemm_reference(xq: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """int8 tokens [T, K] with scales [T, 1] @ (int8 weight [N, K] * scale [N, 1])^T: the exact
    integer product, then the scales (`scale_int32`)."""
    acc = xq.to(torch.float64) @ weight.to(torch.float64).t()  # exact: integers below 2^53
    return scale_int32(acc.to(torch.int32), sx, weight_scale, out_dtype)


def int8_matmul_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          input_scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [T, K] (any float dtype) @ the int8 weight, x quantized per token (or by the static
    scale) as every path quantizes it; returned in x's dtype."""
    xq, sx = quantize_tokens_int8(x, input_scale)
    return int8_gemm_reference(xq, sx, weight, weight_scale, x.dtype)


class Int8Linear(nn.Module):
    """A linear layer with int8 weights: column-parallel or plain (`tp` None), or row-parallel
    (`tp` given: the input is this rank's slice, the outputs are summed over ranks). `matmul`:
    `int8_matmul_reference` or the fast path (`llmserve.kernels.int8_linear.int8_matmul_fast`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, matmul=int8_matmul_reference,
                 tp: TPGroup | None = None) -> None:  # fmt: skip
        super().__init__()
        self.matmul = matmul
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, 1, dtype=torch.float32), requires_grad=False)
        self.input_scale: nn.Parameter | None = None  # a checkpoint's static activation scale
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.matmul(x.reshape(-1, shape[-1]), self.weight, self.weight_scale, self.input_scale)
        y = y.reshape(*shape[:-1], y.shape[-1])
        if self.tp is not None and self.tp.world_size > 1:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


def is_int8(t: torch.Tensor) -> bool:
    return t.dtype == torch.int8


def is_quantized(t: torch.Tensor) -> bool:
    """An FP8 or INT8 weight (the projections' quantized forms that load as a weight and a row scale)."""
    return t.dtype in (torch.int8, torch.float8_e4m3fn)


def quantize_rows_as(dtype: torch.dtype, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` [rows, cols] in `dtype` (FP8 E4M3 or int8) with a float32 scale per row."""
    if dtype == torch.int8:
        return quantize_rows_int8(w)
    from llmserve.model.fp8 import quantize_rows

    return quantize_rows(w)


__all__ = [
    "INT8_MAX",
    "Int8Linear",
    "dequantize_int8",
    "int8_gemm_reference",
    "int8_matmul_reference",
    "is_int8",
    "is_quantized",
    "quantize_rows_as",
    "quantize_rows_int8",
    "quantize_tokens_int8",
    "scale_int32",
]
