"""The FP8 linear layer's product on the fast path: which GEMM runs for how many tokens.

PyTorch reference: `llmserve.model.fp8.fp8_gemm_reference` / `fp8_matmul_reference`.
- few tokens (decode, M <= SMALL_M_ROWS): the split-K Triton kernel (`fp8_gemm_small_m`), which
  beat `torch._scaled_mm` on every 8B projection at M = 1, 16, 32 and 64 on an H200 (QKV: 8.1
  against 18.6 µs at M = 1, 12.8 against 13.5 at 64; gate/up: 31.8 against 46.0 and 33.6
  against 42.3; docs/gpu_fp8_gemm_micro_fused_2026-12-01.json);
- more tokens: `torch._scaled_mm` (cuBLASLt), 1.6-1.8x a bf16 GEMM at M >= 512; from
  `fast_accum_tokens` tokens on (FAST_ACCUM_TOKENS by default) with `use_fast_accum`: the tensor
  cores' FP8 accumulation without cuBLASLt's periodic promotion to full float32, as vLLM's
  FP8 CUTLASS kernels on Hopper run it (their FP8FastAccum schedules). H200, row-wise scales,
  16,384 tokens: gate/up 2,953 against 3,333 µs, qkv 637 / 699, o 414 / 461, down 1,507 / 1,651;
  at 512 tokens no gain (gate/up 112 / 108). The products then differ from the exact
  accumulation's by up to 1.4 % of their largest value (K = 14,336), 0.4 % at K = 4,096
  (docs/history/benchmarks.md, "FP8 at prefill sizes"). A CPU ignores it.
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
