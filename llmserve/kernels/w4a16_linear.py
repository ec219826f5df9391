"""The W4A16 (GPTQ / AWQ) linear layer's product on the fast path: 4-bit weights dequantized
inside the GEMM.

PyTorch reference: `llmserve.model.w4a16.w4a16_matmul_reference` (the whole weight dequantized,
rounded to the activations' dtype, one matmul). The layout is model/w4a16.py's: `qweight` int32
[N, K / 8] (eight inputs a word), `scales` / `zeros` [N, G], `g_idx` int32 [K].
- `w4a16_gemm_triton`: each program reads a tile of 4-bit words ([BLOCK_N, BLOCK_K / 8] int32:
  a quarter of a 16-bit weight's bytes), unpacks the nibbles, looks up each input's group scale
  and zero point (`g_idx`, so act-order checkpoints need no permutation), dequantizes in
  registers as the reference does ((q - z) * s in float32, rounded to x's dtype) and
  accumulates `tl.dot` in float32. For few tokens (decode), where the weight read is the cost.
  Up to `SPLIT_K_RULE.max_rows` tokens K is split too (llmserve/kernels/quant_split_k.py), so that
  enough programs stream the weight; the slices' float32 partials are added in slice order in
  the same launch (deterministic; within float32 rounding of the unsplit sum). A slice is whole
  K steps, so whole 4-bit words; no group alignment is needed, as each input finds its own
  group through `g_idx` (act-order scatters a group over K anyway).
- more tokens (prefill): the reference's dequantize then one 16-bit GEMM (cuBLAS's tensor
  cores), whose cost the many tokens share.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.kernels.quant_split_k import SplitKRule, plan_split, sum_slices

SMALL_M_ROWS = 16  # up to this many tokens the Triton kernel; more: dequantize + cuBLAS
# split-K at decode (llmserve/kernels/quant_split_k.py): up to 16 tokens, K split for about 256
# programs (a heuristic default, the FP8 split-K kernel's measured target; no W4A16 timing yet)
SPLIT_K_RULE = SplitKRule(max_rows=16, programs=256)


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_per_split, stride_xm, stride_qn,
    stride_sn, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
    SPLIT_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)  # K's slice (split-K: `k_per_split` inputs each; one slice: all of K)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k in range(k_start, k_end, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        in_k = ks < k_end
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & in_k[None, :], other=0.0
        )
        tile = in_n[:, None] & in_k[None, :]
        words = tl.load(qw_ptr + cols[:, None] * stride_qn + (ks // 8)[None, :], mask=tile, other=0)
        q = (words >> ((ks % 8) * 4)[None, :]) & 0xF
        g = tl.load(g_ptr + ks, mask=in_k, other=0)
        s = tl.load(s_ptr + cols[:, None] * stride_sn + g[None, :], mask=tile, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + cols[:, None] * stride_sn + g[None, :], mask=tile, other=0).to(tl.float32)
        w = (q.to(tl.float32) - z) * s  # [BLOCK_N, BLOCK_K], the reference's float32 dequantization
        if DOT_F32:  # the interpreter (CPU): float32 products, no bfloat16 dot
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee", out_dtype=tl.float32)
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)), out_dtype=tl.float32)
    mask = (rows[:, None] < M) & in_n[None, :]
    if SPLIT_K > 1:  # the slices' float32 partials, added in slice order by the tile's last slice
        acc, mask = sum_slices(acc, part_ptr, count_ptr, pid_m * tl.num_programs(1) + pid_n, pid_k,
                               rows[:, None] * N + cols[None, :], mask, M * N, SPLIT_K)  # fmt: skip
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def w4a16_gemm_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      g_idx: torch.Tensor, block_n: int = 64, block_k: int = 64,
                      split_k: int | None = None) -> torch.Tensor:  # fmt: skip
    """`w4a16_matmul_reference` by the Triton kernel: x [M, K] (16-bit or float32) in, x's dtype out.
    `split_k`: K's slices (None: the `SPLIT_K_RULE` rule's; 1: the kernel without split-K)."""
    m, k = x.shape
    n = qweight.shape[0]
    assert qweight.shape[1] * 8 == k and g_idx.shape[0] == k and scales.shape == zeros.shape, (x.shape, qweight.shape)
    x = x if x.stride(-1) == 1 else x.contiguous()
    # the interpreter (CPU) rounds float32 -> bfloat16 otherwise than torch: there torch casts
    out = torch.empty((m, n), dtype=x.dtype if x.is_cuda else torch.float32, device=x.device)
    if m == 0:
        return out.to(x.dtype)
    block_m = 16 if m <= 16 else 32
    assert block_k % 8 == 0, block_k  # a K step (and so a slice) holds whole 4-bit words
    tiles_m, tiles_n = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    k_steps = triton.cdiv(k, block_k)
    plan = plan_split(SPLIT_K_RULE, split_k, m, n, k_steps, tiles_m * tiles_n, torch.float32, x.device)
    _w4a16_gemm_kernel[(tiles_m, tiles_n, plan.split_k)](
        x, qweight, scales, zeros, g_idx, out, plan.part, plan.count, m, n, k,
        max(plan.steps, 1) * block_k, x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_F32=not x.is_cuda, SPLIT_K=plan.split_k,
    )  # fmt: skip
    return out.to(x.dtype)


def w4a16_matmul_fast(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      g_idx: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Which path for how many tokens: the Triton kernel up to SMALL_M_ROWS, else dequantize and
    one 16-bit GEMM."""
    if x.shape[0] <= SMALL_M_ROWS:
        return w4a16_gemm_triton(x, qweight, scales.contiguous(), zeros.contiguous(), g_idx)
    from llmserve.model.w4a16 import w4a16_matmul_reference  # (model/ sits above kernels/)

    return w4a16_matmul_reference(x, qweight, scales, zeros, g_idx)


__all__ = ["w4a16_gemm_triton", "w4a16_matmul_fast"]
