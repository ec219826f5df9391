"""The 16-bit linear layer's product on the fast path: which GEMM runs for how many tokens.

PyTorch reference: `torch.nn.functional.linear`.
- one token (batch-1 decode, no bias, on a GPU): the split-K Triton kernel (`gemm_small_m`,
  llmserve/kernels/split_k_gemm.py), one launch that streams the weight once, for every
  projection of the 8B (qkv, o, down and the LM head: faster than cuBLAS; gate/up: as fast
  alone, faster inside a step, as it starts early under programmatic dependent launch,
  llmserve/kernels/pdl.py);
- otherwise `F.linear` (cuBLAS).
Which tiles is decided by `split_k_gemm.bf16_config`, from the sweeps of
`scripts/gpu/dense_gemm_micro.py` and `scripts/gpu/pdl_chain_micro.py` (docs/history/benchmarks.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve.kernels.split_k_gemm import bf16_config, gemm_small_m


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, by the split-K kernel where it was measured faster than cuBLAS
    (`bf16_config`: one token of a 16-bit `x` on a GPU, no bias)."""
    if (bias is None and x.is_cuda and x.dim() == 2 and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16)
            and bf16_config(x.shape[0], weight.shape[0], weight.shape[1]) is not None):  # fmt: skip
        return gemm_small_m(x, weight)
    return F.linear(x, weight, bias)
