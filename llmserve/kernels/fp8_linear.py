"""The FP8 linear layer's product on the fast path: which GEMM runs for how many tokens.

PyTorch reference: `llmserve.model.fp8.fp8_gemm_reference` / `fp8_matmul_reference`.
- few tokens (decode, M <= SMALL_M_ROWS): the split-K Triton kernel (`fp8_gemm_small_m`), which
  beat `torch._scaled_mm` on every 8B projection at M = 1, 16, 32 and 64 on an H200 (QKV: 8.1
  against 18.6 µs at M = 1, 12.8 against 13.5 at 64; gate/up: 31.8 against 46.0 and 33.6
  against 42.3; docs/gpu_fp8_gemm_micro_fused_2026-12-01.json);
- more tokens: `torch._scaled_mm` (cuBLASLt), 1.6-1.8x a bf16 GEMM at M >= 512.
Activations arrive quantized (`Fp8Tokens`, from the fused RMSNorm or SiLU-and-multiply), or
plain, then quantized here by `quantize_tokens_fp8`.
"""

from __future__ import annotations

import torch

from llmserve.kernels.fp8_gemm import fp8_gemm_small_m
from llmserve.kernels.fp8_quant import quantize_tokens_fp8

SMALL_M_ROWS = 64  # = fp8_gemm.MAX_M


def fp8_gemm_fast(xq: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """`(xq * sx) @ (weight * weight_scale)^T` in `out_dtype` for FP8 tokens `xq` [M, K]."""
    if xq.shape[0] <= SMALL_M_ROWS:
        return fp8_gemm_small_m(xq, sx, weight, weight_scale, out_dtype)
    return torch._scaled_mm(xq, weight.t(), scale_a=sx, scale_b=weight_scale.t(), out_dtype=out_dtype)


def fp8_matmul_fused_quant(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           input_scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [T, K] in its float dtype, quantized per token (or with a static scale) by one kernel,
    times the FP8 weight: the fast form of `llmserve.model.fp8.fp8_matmul_reference`."""
    xq, sx = quantize_tokens_fp8(x, input_scale)
    return fp8_gemm_fast(xq, sx, weight, weight_scale, x.dtype)
