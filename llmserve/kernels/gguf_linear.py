"""The product of a GGUF layer kept quantized (model/gguf_linear.py): the blocks dequantized inside
the GEMM, one Triton kernel per block format (Q8_0, Q5_0, Q4_K, Q5_K, Q6_K).

PyTorch reference: `llmserve.model.gguf_linear.gguf_matmul_reference` (each piece dequantized by the
loader's dequantizer, stacked, rounded to the activations' dtype, one matmul). The fields are the
layout of model/gguf_linear.py (`KEPT_FORMATS`), output rows first.
- `gguf_gemm_triton`: each program reads a [BLOCK_N, 32] tile of one sub-block's values a step
  (Q8_0 or Q5_0 a block; Q4_K/Q5_K one of a super-block's eight 32-value sub-blocks: a 32-byte run's low
  or high nibbles, plus Q5_K's fifth bits; Q6_K one of its eight 32-value quarters), decodes the
  sub-block's scale (and min) as the reference does in float32, and accumulates `tl.dot` with the
  matching 32 inputs in float32. For few tokens (decode), where reading the weight is the cost:
  the blocks' bytes (Q4_K 4.5 bits a weight, Q5_0 5.5, Q6_K 6.56, Q8_0 8.5) instead of 16 bits.
- up to `SPLIT_K_RULE.max_rows` tokens K is split too, in whole blocks or super-blocks
  (llmserve/kernels/quant_split_k.py): a 4,096-row weight in 64-wide tiles is 64 programs, too
  few for the SMs; the slices' float32 partials are added in slice order in the same launch.
- more tokens (prefill): the reference's dequantize then one 16-bit GEMM (cuBLAS's tensor
  cores), whose cost the many tokens share.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llmserve.kernels.quant_split_k import SplitKRule, plan_split, sum_slices

SMALL_M_ROWS = 16  # up to this many tokens the Triton kernels; more: dequantize + cuBLAS
# split-K at decode (llmserve/kernels/quant_split_k.py): up to 16 tokens, K split for about 256
# programs (a heuristic default, the FP8 split-K kernel's measured target; no GGUF timing yet)
SPLIT_K_RULE = SplitKRule(max_rows=16, programs=256)
_STEP = {"Q8_0": 32, "Q5_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}  # inputs a kernel's K step reads


@triton.jit
def _dot(acc, x, w, DOT_F32: tl.constexpr):
    """acc + x [BM, 32] @ w [BN, 32]^T in float32 (the interpreter: float32 products)."""
    if DOT_F32:
        acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee", out_dtype=tl.float32)
    else:
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), out_dtype=tl.float32)
    return acc


@triton.jit
def _finish(acc, out_ptr, part_ptr, count_ptr, rows, cols, M, N, stride_om, SPLIT_K: tl.constexpr):
    """Store the tile (split-K: its last slice to arrive stores the slices' sum, in slice order)."""
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT_K > 1:
        acc, mask = sum_slices(acc, part_ptr, count_ptr, tl.program_id(0) * tl.num_programs(1) + tl.program_id(1),
                               tl.program_id(2), rows[:, None] * N + cols[None, :], mask, M * N, SPLIT_K)  # fmt: skip
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _k_scale_min(row_ptr, j: tl.constexpr, mask):
    """Q4_K/Q5_K: sub-block j's 6-bit scale and min from the super-block's 12 bytes at `row_ptr`
    [BN]: bytes 0-3 scales 0-3, 4-7 mins 0-3 (low 6 bits); bytes 8-11 the low 4 bits of scales
    4-7 (low nibble) and mins 4-7 (high nibble), their top 2 bits those of bytes 0-3 and 4-7."""
    if j < 4:
        sc = tl.load(row_ptr + j, mask=mask, other=0).to(tl.int32) & 63
        mn = tl.load(row_ptr + j + 4, mask=mask, other=0).to(tl.int32) & 63
    else:
        low = tl.load(row_ptr + j + 4, mask=mask, other=0).to(tl.int32)
        sc = (low & 0xF) | ((tl.load(row_ptr + j - 4, mask=mask, other=0).to(tl.int32) >> 6) << 4)
        mn = (low >> 4) | ((tl.load(row_ptr + j, mask=mask, other=0).to(tl.int32) >> 6) << 4)
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _q8_0_kernel(x_ptr, qs_ptr, d_ptr, out_ptr, part_ptr, count_ptr, M, N, K, steps, stride_xm, stride_qs, stride_d,
                 stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
                 SPLIT_K: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m, in_n = rows < M, cols < N
    lane = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for b in range(tl.program_id(2) * steps, tl.minimum(tl.program_id(2) * steps + steps, K // 32)):
        q = tl.load(qs_ptr + cols[:, None] * stride_qs + b * 32 + lane[None, :], mask=in_n[:, None], other=0)
        d = tl.load(d_ptr + cols * stride_d + b, mask=in_n, other=0.0).to(tl.float32)
        w = d[:, None] * q.to(tl.float32)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + b * 32 + lane[None, :], mask=in_m[:, None], other=0.0)
        acc = _dot(acc, x, w, DOT_F32)
    _finish(acc, out_ptr, part_ptr, count_ptr, rows, cols, M, N, stride_om, SPLIT_K)


@triton.jit
def _q5_0_kernel(x_ptr, qs_ptr, qh_ptr, d_ptr, out_ptr, part_ptr, count_ptr, M, N, K, steps, stride_xm, stride_qs,
                 stride_qh, stride_d, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
                 SPLIT_K: tl.constexpr):  # fmt: skip
    """Q5_0: w = d * (q - 16); value l's low 4 bits are the low (l < 16) or high nibble of byte l % 16,
    its fifth bit bit l of the block's little-endian 32-bit qh."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m, in_n = rows < M, cols < N
    lane = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for b in range(tl.program_id(2) * steps, tl.minimum(tl.program_id(2) * steps + steps, K // 32)):
        qs = tl.load(qs_ptr + cols[:, None] * stride_qs + b * 16 + (lane % 16)[None, :], mask=in_n[:, None], other=0)
        qh = tl.load(qh_ptr + cols[:, None] * stride_qh + b * 4 + (lane // 8)[None, :], mask=in_n[:, None], other=0)
        low = (qs.to(tl.int32) >> ((lane // 16) * 4)[None, :]) & 0xF
        high = (qh.to(tl.int32) >> (lane % 8)[None, :]) & 1
        d = tl.load(d_ptr + cols * stride_d + b, mask=in_n, other=0.0).to(tl.float32)
        w = d[:, None] * ((low | (high << 4)) - 16).to(tl.float32)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + b * 32 + lane[None, :], mask=in_m[:, None], other=0.0)
        acc = _dot(acc, x, w, DOT_F32)
    _finish(acc, out_ptr, part_ptr, count_ptr, rows, cols, M, N, stride_om, SPLIT_K)


@triton.jit
def _q45_k_kernel(x_ptr, qs_ptr, qh_ptr, sc_ptr, d_ptr, dmin_ptr, out_ptr, part_ptr, count_ptr, M, N, K, steps,
                  stride_xm, stride_qs, stride_qh, stride_sc, stride_d, stride_om, FIFTH_BIT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
                  SPLIT_K: tl.constexpr):  # fmt: skip
    """Q4_K, and Q5_K (`FIFTH_BIT`): w = d * sc * q - dmin * m per 32-value sub-block."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m, in_n = rows < M, cols < N
    lane = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in range(tl.program_id(2) * steps, tl.minimum(tl.program_id(2) * steps + steps, K // 256)):
        d = tl.load(d_ptr + cols * stride_d + s, mask=in_n, other=0.0).to(tl.float32)
        dmin = tl.load(dmin_ptr + cols * stride_d + s, mask=in_n, other=0.0).to(tl.float32)
        for j in tl.static_range(8):  # sub-block j: the low (j even) or high nibbles of run j // 2
            sc, mn = _k_scale_min(sc_ptr + cols * stride_sc + s * 12, j, in_n)
            run = tl.load(qs_ptr + cols[:, None] * stride_qs + s * 128 + (j // 2) * 32 + lane[None, :],
                          mask=in_n[:, None], other=0)  # fmt: skip
            q = (run >> ((j % 2) * 4)) & 0xF
            if FIFTH_BIT:  # bit j of byte l: the fifth bit of value l of sub-block j
                high = tl.load(qh_ptr + cols[:, None] * stride_qh + s * 32 + lane[None, :], mask=in_n[:, None], other=0)
                q = q | (((high >> j) & 1) << 4)
            w = (d * sc)[:, None] * q.to(tl.float32) - (dmin * mn)[:, None]
            x = tl.load(
                x_ptr + rows[:, None] * stride_xm + s * 256 + j * 32 + lane[None, :], mask=in_m[:, None], other=0.0
            )
            acc = _dot(acc, x, w, DOT_F32)
    _finish(acc, out_ptr, part_ptr, count_ptr, rows, cols, M, N, stride_om, SPLIT_K)


@triton.jit
def _q6_k_kernel(x_ptr, ql_ptr, qh_ptr, sc_ptr, d_ptr, out_ptr, part_ptr, count_ptr, M, N, K, steps, stride_xm,
                 stride_ql, stride_qh, stride_sc, stride_d, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 DOT_F32: tl.constexpr, SPLIT_K: tl.constexpr):  # fmt: skip
    """Q6_K: w = d * sc * (q - 32), q six bits, a scale per 16 values. Each half (128 values) of a
    super-block: quarter j's low 4 bits are the low (j < 2) or high nibbles of 32 of its 64 `ql`
    bytes, its top 2 bits bits 2 j of its 32 `qh` bytes."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m, in_n = rows < M, cols < N
    lane = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in range(tl.program_id(2) * steps, tl.minimum(tl.program_id(2) * steps + steps, K // 256)):
        d = tl.load(d_ptr + cols * stride_d + s, mask=in_n, other=0.0).to(tl.float32)
        for h in tl.static_range(2):
            high = tl.load(
                qh_ptr + cols[:, None] * stride_qh + s * 64 + h * 32 + lane[None, :], mask=in_n[:, None], other=0
            )
            for j in tl.static_range(4):
                low = tl.load(ql_ptr + cols[:, None] * stride_ql + s * 128 + h * 64 + (j % 2) * 32 + lane[None, :],
                              mask=in_n[:, None], other=0)  # fmt: skip
                q = (((low >> ((j // 2) * 4)) & 0xF) | (((high >> (2 * j)) & 3) << 4)).to(tl.int32) - 32
                sc = tl.load(sc_ptr + cols[:, None] * stride_sc + s * 16 + h * 8 + 2 * j + (lane // 16)[None, :],
                             mask=in_n[:, None], other=0).to(tl.float32)  # fmt: skip
                w = (d[:, None] * sc) * q.to(tl.float32)
                x = tl.load(x_ptr + rows[:, None] * stride_xm + s * 256 + h * 128 + j * 32 + lane[None, :],
                            mask=in_m[:, None], other=0.0)  # fmt: skip
                acc = _dot(acc, x, w, DOT_F32)
    _finish(acc, out_ptr, part_ptr, count_ptr, rows, cols, M, N, stride_om, SPLIT_K)


def gguf_gemm_triton(x: torch.Tensor, type_name: str, fields: dict[str, torch.Tensor],
                     out: torch.Tensor | None = None, block_n: int = 64, split_k: int | None = None) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ one piece's dequantized weight^T by its format's kernel, into `out` [M, N] (a
    column slice of a wider output is fine) or a new float32 tensor. `split_k`: K's slices, whole
    blocks (Q8_0, Q5_0) or super-blocks (K-quants) each (None: the `SPLIT_K_RULE` rule's; 1: none)."""
    m, k = x.shape
    n = next(iter(fields.values())).shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    if out is None:
        out = torch.empty((m, n), dtype=torch.float32, device=x.device)
    assert out.shape == (m, n) and out.stride(-1) == 1, (out.shape, m, n)
    if m == 0:
        return out
    if type_name not in _STEP:
        raise ValueError(f"no kernel for GGUF blocks of type {type_name}")
    f = {name: t.contiguous() for name, t in fields.items()}
    block_m = 16
    tiles_m, tiles_n = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    k_steps = k // _STEP[type_name]
    plan = plan_split(SPLIT_K_RULE, split_k, m, n, k_steps, tiles_m * tiles_n, torch.float32, x.device)
    grid = (tiles_m, tiles_n, plan.split_k)
    common = dict(BLOCK_M=block_m, BLOCK_N=block_n, DOT_F32=not x.is_cuda, SPLIT_K=plan.split_k)
    head = (out, plan.part, plan.count, m, n, k, max(plan.steps, 1), x.stride(0))
    if type_name == "Q8_0":
        _q8_0_kernel[grid](x, f["qs"], f["d"], *head, f["qs"].stride(0), f["d"].stride(0), out.stride(0), **common)
    elif type_name == "Q5_0":
        _q5_0_kernel[grid](x, f["qs"], f["qh"], f["d"], *head, f["qs"].stride(0), f["qh"].stride(0), f["d"].stride(0),
                           out.stride(0), **common)  # fmt: skip
    elif type_name in ("Q4_K", "Q5_K"):
        qh = f.get("qh", f["qs"])  # (Q4_K has none: never read)
        _q45_k_kernel[grid](x, f["qs"], qh, f["scales"], f["d"], f["dmin"], *head, f["qs"].stride(0), qh.stride(0),
                            f["scales"].stride(0), f["d"].stride(0), out.stride(0), FIFTH_BIT=type_name == "Q5_K",
                            **common)  # fmt: skip
    else:
        _q6_k_kernel[grid](x, f["ql"], f["qh"], f["scales"], f["d"], *head, f["ql"].stride(0), f["qh"].stride(0),
                           f["scales"].stride(0), f["d"].stride(0), out.stride(0), **common)  # fmt: skip
    return out


def gguf_matmul_fast(x: torch.Tensor, pieces: list, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`gguf_matmul_reference` on the fast path: up to SMALL_M_ROWS tokens each kept piece's kernel
    writes its columns (dense pieces a matmul); more, the reference's dequantize and one GEMM."""
    if x.shape[0] > SMALL_M_ROWS:
        from llmserve.model.gguf_linear import gguf_matmul_reference  # (model/ sits above kernels/)

        return gguf_matmul_reference(x, pieces, bias)
    # the interpreter (CPU) rounds float32 -> bfloat16 otherwise than torch: there torch casts
    out = torch.empty((x.shape[0], sum(p.rows for p in pieces)), dtype=x.dtype if x.is_cuda else torch.float32,
                      device=x.device)  # fmt: skip
    col = 0
    for p in pieces:
        cols = out[:, col : col + p.rows]
        if p.type_name == "dense":
            cols.copy_(F.linear(x, p.weight))
        else:
            gguf_gemm_triton(x, p.type_name, p.fields(), cols)
        col += p.rows
    out = out.to(x.dtype)
    return out if bias is None else out + bias


__all__ = ["SMALL_M_ROWS", "gguf_gemm_triton", "gguf_matmul_fast"]
