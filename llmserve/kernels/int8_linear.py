"""The INT8 (W8A8) linear layer's product on the fast path: int8 tokens times int8 weights,
accumulated in int32, scaled by the tokens' and the weight rows' scales.

PyTorch reference: `llmserve.model.int8.int8_gemm_reference` / `int8_matmul_reference` (the exact
integer product, then `scale_int32`). Both GEMMs here give the same int32 accumulator (integer
sums are exact in any order) and apply the same epilogue in the same order, so they equal the
reference bit for bit:
- `int8_gemm_triton`: a Triton GEMM (`tl.dot` of int8 tiles into an int32 accumulator, the
  scales applied in the epilogue, one launch) for few tokens (decode: M <= SMALL_M_ROWS), where
  cuBLAS's int8 GEMM cannot run (`torch._int_mm` needs more than 16 rows on CUDA); up to
  `SPLIT_K_RULE.max_rows` tokens split along K too (llmserve/kernels/quant_split_k.py), so that enough
  programs stream the weight, the slices' int32 partials added in the same launch (still exact);
- `int_mm`: `torch._int_mm` (cuBLASLt's int8 GEMM on a GPU, oneDNN on a CPU) behind a wrapper
  that meets CUDA's shape rules (M > 16, K and N multiples of 8) by padding with zeros, which
  add nothing to an integer sum; then `scale_int32`.
Activations are quantized per token by `llmserve.model.int8.quantize_tokens_int8` (the same
function as the reference: the same bytes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.kernels.quant_split_k import SplitKRule, plan_split, sum_slices

# (llmserve.model.int8's quantization and epilogue are imported where they are called: kernels/ sits
# below model/ in the layers, docs/architecture.md)

SMALL_M_ROWS = 16  # up to this many tokens the Triton kernel; more: torch._int_mm (cuBLASLt)
_CUDA_MIN_M = 17  # torch._int_mm on CUDA: more than 16 rows
_CUDA_MULTIPLE = 8  # ... and K, N multiples of 8
# split-K at decode (llmserve/kernels/quant_split_k.py): up to 16 tokens, K split for about 256
# programs (a heuristic default, the FP8 split-K kernel's measured target; no int8 timing yet)
SPLIT_K_RULE = SplitKRule(max_rows=16, programs=256)


@triton.jit
def _int8_gemm_kernel(
    x_ptr, w_ptr, sx_ptr, sw_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
    stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)  # K's slice (split-K: `k_per_split` inputs each; one slice: all of K)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k in range(k_start, k_end, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        in_k = ks < k_end
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & in_k[None, :], other=0)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=(cols[:, None] < N) & in_k[None, :], other=0)
        acc = tl.dot(x, tl.trans(w), acc, out_dtype=tl.int32)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT_K > 1:  # the slices' int32 partials (exact in any order), added by the tile's last slice
        acc, mask = sum_slices(acc, part_ptr, count_ptr, pid_m * tl.num_programs(1) + pid_n, pid_k,
                               rows[:, None] * N + cols[None, :], mask, M * N, SPLIT_K)  # fmt: skip
    # the epilogue of `scale_int32`: float32, times the token's scale, then the row's
    sx = tl.load(sx_ptr + rows, mask=rows < M, other=0.0)
    sw = tl.load(sw_ptr + cols, mask=cols < N, other=0.0)
    y = acc.to(tl.float32) * sx[:, None] * sw[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def int8_gemm_triton(xq: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     out_dtype: torch.dtype, block_n: int = 64, block_k: int = 128,
                     split_k: int | None = None) -> torch.Tensor:  # fmt: skip
    """`int8_gemm_reference` by the Triton kernel: int8 `xq` [M, K], float32 `sx` [M, 1], int8
    `weight` [N, K], float32 `weight_scale` [N, 1]. `split_k`: K's slices (None: the `SPLIT_K_RULE`
    rule's; 1: the kernel without split-K); every count gives the same bits."""
    m, k = xq.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and xq.dtype == weight.dtype == torch.int8, (xq.shape, weight.shape)
    xq = xq if xq.stride(-1) == 1 else xq.contiguous()
    # the interpreter (CPU) rounds float32 -> bfloat16 otherwise than torch: there torch casts
    out = torch.empty((m, n), dtype=out_dtype if xq.is_cuda else torch.float32, device=xq.device)
    if m == 0:
        return out.to(out_dtype)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    tiles_m, tiles_n = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    k_steps = triton.cdiv(k, block_k)
    plan = plan_split(SPLIT_K_RULE, split_k, m, n, k_steps, tiles_m * tiles_n, torch.int32, xq.device)
    _int8_gemm_kernel[(tiles_m, tiles_n, plan.split_k)](
        xq, weight, sx.reshape(-1).contiguous(), weight_scale.reshape(-1).contiguous(), out, plan.part,
        plan.count, m, n, k, max(plan.steps, 1) * block_k, xq.stride(0),
        weight.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=plan.split_k,
    )  # fmt: skip
    return out.to(out_dtype)


def int_mm(a: torch.Tensor, b: torch.Tensor, cuda_rules: bool | None = None) -> torch.Tensor:
    """`a` [M, K] int8 @ `b` [K, N] int8 -> int32 [M, N] by `torch._int_mm`. With CUDA's rules
    (`cuda_rules`, default: on a CUDA tensor) the operands are padded with zeros to M > 16 and K,
    N multiples of 8, and the result cut back (zeros add nothing to the integer sums)."""
    m, k = a.shape
    n = b.shape[1]
    if not (a.is_cuda if cuda_rules is None else cuda_rules):
        return torch._int_mm(a, b)
    pad_m = max(_CUDA_MIN_M - m, 0)
    pad_k = -k % _CUDA_MULTIPLE
    pad_n = -n % _CUDA_MULTIPLE
    if pad_m or pad_k:
        a = torch.nn.functional.pad(a, (0, pad_k, 0, pad_m))
    if pad_k or pad_n:
        b = torch.nn.functional.pad(b, (0, pad_n, 0, pad_k))
    out = torch._int_mm(a, b)
    return out[:m, :n] if (pad_m or pad_n) else out


def int8_gemm_int_mm(xq: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     out_dtype: torch.dtype, cuda_rules: bool | None = None) -> torch.Tensor:  # fmt: skip
    """`int8_gemm_reference` by `int_mm`, then `scale_int32`."""
    from llmserve.model.int8 import scale_int32

    return scale_int32(int_mm(xq, weight.t(), cuda_rules), sx, weight_scale, out_dtype)


def int8_gemm_fast(xq: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """Which GEMM for how many tokens: the Triton kernel up to SMALL_M_ROWS (on a GPU), else
    `torch._int_mm`. Off a GPU the reference: `torch._int_mm` runs there, but the CPU's took
    2.26 s for 512 x 576 x 3,072 against the reference's 0.10 s (float64 BLAS) and bf16's 0.35 s
    (one thread, 2026-12-07)."""
    if not xq.is_cuda:
        from llmserve.model.int8 import int8_gemm_reference

        return int8_gemm_reference(xq, sx, weight, weight_scale, out_dtype)
    if xq.shape[0] <= SMALL_M_ROWS:
        return int8_gemm_triton(xq, sx, weight, weight_scale, out_dtype)
    return int8_gemm_int_mm(xq, sx, weight, weight_scale, out_dtype)


def int8_matmul_fast(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     input_scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [T, K] in its float dtype, quantized per token (or with a static scale), times the int8
    weight: the fast form of `llmserve.model.int8.int8_matmul_reference`."""
    from llmserve.model.int8 import quantize_tokens_int8

    xq, sx = quantize_tokens_int8(x, input_scale)
    return int8_gemm_fast(xq, sx, weight, weight_scale, x.dtype)


__all__ = ["int8_gemm_fast", "int8_gemm_int_mm", "int8_gemm_triton", "int8_matmul_fast", "int_mm"]
