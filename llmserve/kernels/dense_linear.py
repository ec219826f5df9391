"""The 16-bit linear layer's product on the fast path: which GEMM runs for how many tokens, and the
products that take their input's last elementwise op along.

PyTorch references: `torch.nn.functional.linear`, and `llmserve.model.layers.norm_linear` /
`silu_and_mul_linear` (the op, then `F.linear`).
- one token (batch-1 decode, no bias, on a GPU) and a weight shape where it was measured faster:
  the split-K Triton kernel (`gemm_small_m`, llmserve/kernels/split_k_gemm.py), one launch that
  streams the weight once (the 8B's qkv, o, down and LM head);
- at one token, the RMSNorm before qkv and gate/up and the SiLU-and-multiply before down run
  inside that kernel as it loads its input (`norm_linear`, `silu_and_mul_linear`): a launch and a
  round trip of the activations less each (the norm's or activation's kernel, about 3 µs, and the
  gap between two kernels of a CUDA graph);
- otherwise `F.linear` (cuBLAS), after the op's own kernel.
Where is decided by `split_k_gemm.bf16_config` / `fused_config`, from the sweep of
`scripts/gpu/dense_gemm_micro.py` (docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve.kernels.activation import silu_and_mul
from llmserve.kernels.norm import fused_add_rms_norm, rms_norm
from llmserve.kernels.split_k_gemm import (
    bf16_config,
    fused_config,
    gemm_small_m,
    rms_norm_gemm_small_m,
    silu_mul_gemm_small_m,
)


def _split_k_takes(x: torch.Tensor, weight: torch.Tensor, config) -> bool:
    """A 16-bit `x` of unit-stride rows on a GPU, in `weight`'s dtype, and tiles for its shape."""
    return (x.is_cuda and x.dim() == 2 and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and x.stride(-1) == 1 and config(x.shape[0], weight.shape[0], weight.shape[1]) is not None)  # fmt: skip


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, by the split-K kernel where it was measured faster than cuBLAS
    (`bf16_config`: one token of a 16-bit `x` on a GPU, no bias, N outside the MLP's gate/up range)."""
    if bias is None and _split_k_takes(x, weight, bf16_config):
        return gemm_small_m(x, weight)
    return F.linear(x, weight, bias)


def norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(F.linear(RMSNorm(x + residual)), x + residual)`; without a residual `(F.linear(RMSNorm(x)), x)`.
    One launch at one token (`fused_config`), else the norm's kernel and `dense_linear`."""
    if (_split_k_takes(x, weight, fused_config) and norm_weight.dtype == x.dtype and norm_weight.is_contiguous()
            and (residual is None or (residual.dtype == x.dtype and residual.stride(-1) == 1))):  # fmt: skip
        return rms_norm_gemm_small_m(x, residual, norm_weight, eps, weight)
    if residual is None:
        return dense_linear(rms_norm(x, norm_weight, eps), weight), x
    h, residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    return dense_linear(h, weight), residual


def silu_and_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(silu(gate) * up, weight)` of `gate_up` [T, 2K]: one launch at one token
    (`fused_config`), else the activation's kernel and `dense_linear`."""
    if _split_k_takes(gate_up, weight, fused_config):
        return silu_mul_gemm_small_m(gate_up, weight)
    return dense_linear(silu_and_mul(gate_up), weight)
