"""The LoRA expand as one dense GEMM per output slice, for steps of many tokens.

The Triton expand (llmserve/kernels/lora.py) reads each row block's B tile per slot and
re-reads the shrink's partial sums for every column block: at 512 decode tokens it ran at a
third of the bandwidth that its read and write of y need (docs/history/benchmarks.md, "multi-LoRA").
Here the partial sums are added once, each token's rank-sized row is placed in its slot's
columns of a [T, slots * max_rank] matrix (zero elsewhere, and zero for tokens without an
adapter), and cuBLAS adds that matrix times every slot's B (`ProjectionLoRA.b_all`, a view of
the store) into y: K = slots x max_rank (128 for 8 slots of rank 16), so its FLOPs are a few
per cent of the base GEMM's, and y is read and written once. No host sync and fixed shapes, so
it is captured in CUDA graphs like the kernels.

Same result as `lora_expand_reference` up to float32 summation order: t rounded to B's dtype,
the products summed in float32, one rounding into y.
"""

from __future__ import annotations

import torch

from llmserve.lora_batch import LoRABatch


def slot_columns(t: torch.Tensor, batch: LoRABatch, dtype: torch.dtype) -> torch.Tensor:
    """t [T, slices, R] or the shrink's [splits, T, slices, R] -> [slices, T, slots * R] in
    `dtype`: token i's row in its slot's R columns, zero elsewhere. `torch.where`, not a
    multiplication: rows of tokens without an adapter were never written (any bits)."""
    if t.dim() == 4:
        t = t.sum(0)
    num_tokens, slices, rank = t.shape
    slots = torch.arange(batch.num_slots, device=t.device, dtype=batch.token_slots.dtype)
    mine = (batch.token_slots[:num_tokens, None] == slots[None, :])[:, None, :, None]  # [T, 1, S, 1]
    spread = torch.where(mine, t[:, :, None, :], 0.0)  # [T, slices, S, R]
    return spread.to(dtype).permute(1, 0, 2, 3).reshape(slices, num_tokens, -1)


def lora_expand_gemm(y: torch.Tensor, t: torch.Tensor, b_all: torch.Tensor, slice_bounds: tuple[int, ...],
                     batch: LoRABatch) -> None:  # fmt: skip
    """y [T, out] += per slice j: cols_j @ b_all[bounds[j]:bounds[j + 1]]^T in place, where
    cols = slot_columns(t); b_all [out, slots * max_rank]."""
    if y.shape[0] == 0:
        return
    cols = slot_columns(t, batch, b_all.dtype)
    for j in range(len(slice_bounds) - 1):
        lo, hi = slice_bounds[j], slice_bounds[j + 1]
        y[:, lo:hi].addmm_(cols[j], b_all[lo:hi].t())
