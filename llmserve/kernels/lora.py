"""Batched multi-LoRA in Triton: shrink (x @ A^T of each token's adapter) and expand (t @ B^T
added into the fused projection's output, per output slice).

PyTorch reference: `llmserve.lora.reference` (lora_shrink_reference, lora_expand_reference).

Tokens come grouped by adapter slot (`LoRABatch.sorted_tokens`, `slot_starts`, `slot_counts`,
computed once per step), so a program works on up to BLOCK_M tokens of one slot and reads that
slot's A or B tile once for all of them: prefill tokens of one request share their tiles, and
decode tokens of requests on the same adapter do too. The grid's first axis walks the step's
row blocks (`LoRABatch.row_blocks`: each one a slot and its first row), at most
ceil(T / BLOCK_M) + slots of them; programs past the last block return at once. A grid of
every row block times every slot spent most of its programs on nothing (at 512 decode tokens
over 8 adapters, 7 in 8 of them). The grid depends only on the token count and the fixed
number of slots, never on which slots are used, so a CUDA graph captured for a token count
replays for any mix of adapters.

The shrink splits the input dimension K over `splits` programs when the step has few tokens
(a decode step of one token has one row block: without the split, one program per slice walks
all of K alone, and the kernel is bound by that walk's latency, tens of times what reading the
A tile's bytes takes). Each split writes its partial sums to its own plane
of t; the expand adds the planes in split order when it reads t, so the result is
deterministic (no atomics) and needs no extra launch. The split count depends only on the
token count, so CUDA graphs keep working.

Layouts (llmserve/lora/slot_weights.py): A [slots, slices, max_rank, in], B [slots, out,
max_rank] with the slices' rows concatenated as the fused output is; t [splits, T, slices,
max_rank] in float32, the per-slot scaling already applied by the shrink; rows of tokens
without an adapter are left unwritten (the expand never reads them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.lora_batch import LoRABatch, max_row_blocks, row_block

# Launch tuning, all of it (row blocks of BLOCK_M tokens: llmserve/lora_batch.py `row_block`)
SHRINK_BLOCK_K = 64  # shrink: input columns a step
SHRINK_PROGRAMS = 128  # shrink: K is split until the step has about this many programs
SHRINK_MIN_K_BLOCKS = 4  # shrink: each split keeps at least this many K steps of work
EXPAND_BLOCK_N = 64  # expand: output columns a program
# expand, row blocks of 64: wider column blocks, half the programs, each re-reading the shrink's
# partial sums half as often (at 512 tokens the 64-wide blocks ran at a third of the bandwidth)
EXPAND_BLOCK_N_WIDE = 128
EXPAND_WIDE_BLOCK_M = 64
NUM_WARPS = 4  # both kernels


@triton.jit
def _block_rows(blocks_ptr, sorted_ptr, starts_ptr, counts_ptr, pid, BLOCK_M: tl.constexpr):
    """Row block `pid` of the step (llmserve/lora_batch.py `slot_row_blocks`): its slot (-1: no
    block), the indices in the batch of its tokens, and which of them are real."""
    s = tl.load(blocks_ptr + 2 * pid)
    first = tl.load(blocks_ptr + 2 * pid + 1)
    offs = first + tl.arange(0, BLOCK_M)
    count = tl.where(s >= 0, tl.load(counts_ptr + tl.maximum(s, 0)), 0)
    row_ok = offs < count
    tok = tl.load(sorted_ptr + tl.load(starts_ptr + tl.maximum(s, 0)) + offs, mask=row_ok, other=0).to(tl.int64)
    return s, tok, row_ok


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, scale_ptr, blocks_ptr, sorted_ptr, starts_ptr, counts_ptr, t_ptr, K, K_CHUNK,
    stride_xm, stride_as, stride_aj, stride_ar, stride_ts, stride_tm, stride_tj,
    RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    j = tl.program_id(1)  # output slice (q, k, v ...): each has its own A
    split = tl.program_id(2)  # which K_CHUNK of the input dimension
    s, tok, row_ok = _block_rows(blocks_ptr, sorted_ptr, starts_ptr, counts_ptr, tl.program_id(0), BLOCK_M)
    if s < 0:
        return
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < RANK
    a_base = a_ptr + s.to(tl.int64) * stride_as + j * stride_aj
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    k_lo = split * K_CHUNK
    k_hi = tl.minimum(k_lo + K_CHUNK, K)
    for k in range(k_lo, k_hi, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        x = tl.load(x_ptr + tok[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_base + rs[:, None] * stride_ar + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(a), input_precision=DOT_PREC)
    acc = acc * tl.load(scale_ptr + s)
    t_ptrs = t_ptr + split.to(tl.int64) * stride_ts + tok[:, None] * stride_tm + j * stride_tj + rs[None, :]
    tl.store(t_ptrs, acc, mask=row_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(
    t_ptr, b_ptr, y_ptr, offsets_ptr, blocks_ptr, sorted_ptr, starts_ptr, counts_ptr, SPLITS,
    stride_ts, stride_tm, stride_tj, stride_bs, stride_bn, stride_ym, N_BLOCKS,
    RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    j = tl.program_id(1) // N_BLOCKS  # output slice
    nb = tl.program_id(1) % N_BLOCKS  # column block inside the slice
    lo = tl.load(offsets_ptr + j)
    hi = tl.load(offsets_ptr + j + 1)
    s, tok, row_ok = _block_rows(blocks_ptr, sorted_ptr, starts_ptr, counts_ptr, tl.program_id(0), BLOCK_M)
    if (s < 0) | (lo + nb * BLOCK_N >= hi):  # no row block here, or past a narrower slice
        return
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < RANK
    cols = lo + nb * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = cols < hi
    t_ptrs = t_ptr + tok[:, None] * stride_tm + j * stride_tj + rs[None, :]
    t_ok = row_ok[:, None] & r_ok[None, :]
    t = tl.load(t_ptrs, mask=t_ok, other=0.0)
    for split in range(1, SPLITS):  # the shrink's partial sums, added in split order
        t += tl.load(t_ptrs + split * stride_ts, mask=t_ok, other=0.0)
    b = tl.load(b_ptr + s.to(tl.int64) * stride_bs + cols[:, None] * stride_bn + rs[None, :],
                mask=c_ok[:, None] & r_ok[None, :], other=0.0)  # fmt: skip
    delta = tl.dot(t.to(b.dtype), tl.trans(b), input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N] float32
    y_ptrs = y_ptr + tok[:, None] * stride_ym + cols[None, :]
    mask = row_ok[:, None] & c_ok[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs


def shrink_splits(num_tokens: int, slices: int, in_features: int, block_k: int = SHRINK_BLOCK_K) -> int:
    """How many programs share the input dimension: enough for about SHRINK_PROGRAMS (one wave
    of programs on a large GPU) when the step has few row blocks, one when it has many; each
    split keeps at least SHRINK_MIN_K_BLOCKS K blocks of work. A function of the token count
    alone (CUDA graphs)."""
    programs = max(1, triton.cdiv(num_tokens, row_block(num_tokens)) * slices)
    most = max(1, in_features // (SHRINK_MIN_K_BLOCKS * block_k))
    return max(1, min(most, SHRINK_PROGRAMS // programs))


def lora_shrink(x: torch.Tensor, a: torch.Tensor, scaling: torch.Tensor, batch: LoRABatch,
                block_k: int = SHRINK_BLOCK_K, num_warps: int = NUM_WARPS,
                splits: int | None = None) -> torch.Tensor:  # fmt: skip
    """x [T, in], a [slots, slices, max_rank, in], scaling [slots] -> t [splits, T, slices,
    max_rank] float32, whose sum over the first axis is scaling[s] * x @ a[s, j]^T for each token
    of slot s; rows of tokens without a slot are not written. `splits`: how many parts of the
    input dimension are summed separately (default: `shrink_splits`)."""
    num_tokens, k = x.shape
    num_slots, slices, rank, k_a = a.shape
    assert k_a == k and x.dtype == a.dtype and a.stride(-1) == 1, (x.shape, x.dtype, a.shape, a.dtype)
    splits = splits or shrink_splits(num_tokens, slices, k, block_k)
    k_chunk = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_chunk)  # no empty split
    t = torch.empty(splits, num_tokens, slices, rank, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return t
    if x.stride(-1) != 1:
        x = x.contiguous()
    block_m = row_block(num_tokens)
    _shrink_kernel[(max_row_blocks(num_tokens, num_slots), slices, splits)](
        x, a, scaling, batch.row_blocks, batch.sorted_tokens, batch.slot_starts, batch.slot_counts, t, k, k_chunk,
        x.stride(0), a.stride(0), a.stride(1), a.stride(2), t.stride(0), t.stride(1), t.stride(2),
        RANK=rank, BLOCK_M=block_m, BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_K=block_k,
        DOT_PREC=_dot_precision(x.dtype), num_warps=num_warps,
    )  # fmt: skip
    return t


def lora_expand(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, slice_offsets: torch.Tensor, max_slice_width: int,
                batch: LoRABatch, block_n: int | None = None, num_warps: int = NUM_WARPS) -> None:  # fmt: skip
    """y [T, out] += t[:, j] @ b[s, offsets[j]:offsets[j + 1]]^T for each token of slot s and each
    slice j, in place (t rounded to b's dtype, the sum in float32); tokens without a slot keep y.
    t: [T, slices, max_rank], or the shrink's [splits, T, slices, max_rank] (summed here)."""
    num_tokens = y.shape[0]
    num_slots, _, rank = b.shape
    slices = slice_offsets.shape[0] - 1
    if t.dim() == 3:
        t = t.unsqueeze(0)
    assert t.shape[1:] == (num_tokens, slices, rank) and y.stride(-1) == 1 and b.stride(-1) == 1, (
        t.shape,
        y.shape,
        b.shape,
    )
    assert t.stride(-1) == 1, t.stride()
    if num_tokens == 0:
        return
    block_m = row_block(num_tokens)
    block_n = block_n or (EXPAND_BLOCK_N_WIDE if block_m >= EXPAND_WIDE_BLOCK_M else EXPAND_BLOCK_N)
    n_blocks = triton.cdiv(max_slice_width, block_n)
    _expand_kernel[(max_row_blocks(num_tokens, num_slots), slices * n_blocks)](
        t, b, y, slice_offsets, batch.row_blocks, batch.sorted_tokens, batch.slot_starts, batch.slot_counts, t.shape[0],
        t.stride(0), t.stride(1), t.stride(2), b.stride(0), b.stride(1), y.stride(0), n_blocks,
        RANK=rank, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(rank)),
        DOT_PREC=_dot_precision(b.dtype), num_warps=num_warps,
    )  # fmt: skip
