"""The FP8 linear layer's product on the fast path: which GEMM runs for how many tokens.

PyTorch reference: `llmserve.model.fp8.fp8_gemm_reference` / `fp8_matmul_reference`.
- few tokens (decode, M <= SMALL_M_ROWS): the split-K Triton kernel (`fp8_gemm_small_m`), which
  beats `torch._scaled_mm` on every 8B projection at M = 1 to 64
  (docs/gpu_fp8_gemm_micro_fused_2026-12-01.json);
- more tokens: `torch._scaled_mm` (cuBLASLt); from `fast_accum_tokens` tokens on
  (FAST_ACCUM_TOKENS by default) with `use_fast_accum`: the tensor cores' FP8 accumulation
  without cuBLASLt's periodic promotion to full float32, as vLLM's FP8 CUTLASS kernels on Hopper
  run it (their FP8FastAccum schedules): about 10 % faster at 16,384 tokens, no gain at
  512. The products then differ from the exact accumulation's by up to 1.4 % of their largest
  value (K = 14,336), 0.4 % at K = 4,096 (docs/history/benchmarks.md, "FP8 past every target of
  issue 19"). A CPU ignores it.
Activations arrive quantized (`Fp8Tokens`, from the fused RMSNorm or SiLU-and-multiply), or
plain, then quantized here by `quantize_tokens_fp8`.
"""

from __future__ import annotations

import torch

from llmserve.kernels.fp8_quant import quantize_tokens_fp8
from llmserve.kernels.split_k_gemm import fp8_gemm_small_m

SMALL_M_ROWS = 64  # = fp8_gemm.MAX_M
FAST_ACCUM_TOKENS = 1024  # the engine's --fp8-fast-accum-tokens default


def fp8_gemm_fast(xq: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  out_dtype: torch.dtype, fast_accum_tokens: int = FAST_ACCUM_TOKENS) -> torch.Tensor:  # fmt: skip
    """`(xq * sx) @ (weight * weight_scale)^T` in `out_dtype` for FP8 tokens `xq` [M, K]; with
    fast accumulation from `fast_accum_tokens` tokens on (0: never)."""
    rows = xq.shape[0]
    if rows <= SMALL_M_ROWS:
        return fp8_gemm_small_m(xq, sx, weight, weight_scale, out_dtype)
    fast = 0 < fast_accum_tokens <= rows and xq.is_cuda
    return torch._scaled_mm(xq, weight.t(), scale_a=sx, scale_b=weight_scale.t(), out_dtype=out_dtype,
                            use_fast_accum=fast)  # fmt: skip


def fp8_matmul_fused_quant(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           input_scale: torch.Tensor | None = None,
                           fast_accum_tokens: int = FAST_ACCUM_TOKENS) -> torch.Tensor:  # fmt: skip
    """x [T, K] in its float dtype, quantized per token (or with a static scale) by one kernel,
    times the FP8 weight: the fast form of `llmserve.model.fp8.fp8_matmul_reference`."""
    xq, sx = quantize_tokens_fp8(x, input_scale)
    return fp8_gemm_fast(xq, sx, weight, weight_scale, x.dtype, fast_accum_tokens)
