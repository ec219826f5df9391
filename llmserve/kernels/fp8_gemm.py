"""An FP8 GEMM for few tokens (decode), in Triton: split along K, row-wise scales.

PyTorch reference: `llmserve.model.fp8.fp8_matmul_reference` (dequantize both, multiply in
float32). On an H200, `torch._scaled_mm` read FP8 weights at only 1.1-3.2 TB/s at M <= 128
(a bf16 GEMM reads at 2.6-4.1 TB/s), so the halved bytes did not show at decode
(docs/benchmarks.md, "FP8 first measured"). With few rows, the weight matrix is read once;
the grid covers N in tiles and K in `split_k` slices, so enough programs stream it. Each
program accumulates `x_tile @ w_tile^T` in float32 (`tl.dot` on FP8 operands), applies the
two scales, and writes its partial sum; the partials are added in a fixed order (the same
result every run, unlike atomics).

Not wired into the engine yet: `scripts/gpu/fp8_gemm_micro.py` times it against
`_scaled_mm` first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_M = 64  # rows this kernel is for; more rows: torch._scaled_mm


@triton.jit
def _fp8_gemm_split_k_kernel(
    x_ptr, w_ptr, sx_ptr, sw_ptr, part_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k in range(k_start, k_end, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        in_k = ks < k_end
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & in_k[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=(cols[:, None] < N) & in_k[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), out_dtype=tl.float32)
    sx = tl.load(sx_ptr + rows, mask=rows < M, other=0.0)
    sw = tl.load(sw_ptr + cols, mask=cols < N, other=0.0)
    acc = acc * sx[:, None] * sw[None, :]
    out = part_ptr + pid_k * M * N + rows[:, None] * N + cols[None, :]
    tl.store(out, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


def fp8_gemm_small_m(xq: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     out_dtype: torch.dtype, split_k: int | None = None, block_n: int = 64,
                     block_k: int = 128, num_warps: int = 4) -> torch.Tensor:  # fmt: skip
    """`(xq * sx) @ (weight * weight_scale)^T` for FP8 `xq` [M, K] (M <= MAX_M) with float32
    scales `sx` [M, 1], FP8 `weight` [N, K] with `weight_scale` [N, 1]; returned in `out_dtype`."""
    m, k = xq.shape
    n = weight.shape[0]
    assert m <= MAX_M and weight.shape[1] == k, (xq.shape, weight.shape)
    if xq.stride(-1) != 1:
        xq = xq.contiguous()
    if m == 0:
        return torch.empty((0, n), dtype=out_dtype, device=xq.device)
    tiles_n = triton.cdiv(n, block_n)
    if split_k is None:  # enough programs to stream the weights: about 4 per SM on a large GPU
        split_k = max(1, min(triton.cdiv(k, block_k), 512 // tiles_n))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    partials = torch.empty((split_k, m, n), dtype=torch.float32, device=xq.device)
    _fp8_gemm_split_k_kernel[(tiles_n, split_k)](
        xq, weight, sx.reshape(-1).contiguous(), weight_scale.reshape(-1).contiguous(), partials,
        m, n, k, k_per_split, xq.stride(0), weight.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
    )  # fmt: skip
    return partials.sum(dim=0).to(out_dtype)
