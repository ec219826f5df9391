"""Batched LoRA in plain PyTorch: the CPU path, and the oracle the Triton kernels
(llmserve/kernels/lora.py) are tested against.

For each token with an adapter slot s, and each output slice j of a fused projection:
  shrink: t[:, j] = scaling[s] * x @ A[s, j]^T             (float32, [T, slices, max_rank])
  expand: y[:, offsets[j]:offsets[j+1]] += t[:, j] @ B[s, offsets[j]:offsets[j+1]]^T
so y = base(x) + scaling * (x @ A^T) @ B^T per token, as PEFT computes an unmerged adapter.
The scaling is applied in the shrink, on max_rank columns rather than on the whole output.
One loop over slots, reading only `token_slots`: an independent check of the kernels' grouping.
"""

from __future__ import annotations

import torch

from llmserve.lora_batch import LoRABatch


def lora_shrink_reference(x: torch.Tensor, a: torch.Tensor, scaling: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    """x [T, in], a [slots, slices, max_rank, in], scaling [slots] -> t [T, slices, max_rank]
    float32, zero for tokens without an adapter."""
    num_tokens = x.shape[0]
    t = torch.zeros(num_tokens, a.shape[1], a.shape[2], dtype=torch.float32, device=x.device)
    slots = batch.token_slots[:num_tokens]
    for s in range(a.shape[0]):
        rows = (slots == s).nonzero().squeeze(1)
        if rows.numel():
            t[rows] = torch.einsum("tk,jrk->tjr", x[rows].float(), a[s].float()) * scaling[s]
    return t


def lora_expand_reference(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, slice_offsets: torch.Tensor,
                          max_slice_width: int, batch: LoRABatch) -> None:  # fmt: skip
    """y [T, out] += per slice j: t[:, j] [T, max_rank] @ b[slot, offsets[j]:offsets[j+1]]^T, in
    place; t is rounded to b's dtype first and the sum is taken in float32 (as the kernel does)."""
    del max_slice_width  # the kernel's grid needs it
    offsets = slice_offsets.tolist()
    slots = batch.token_slots[: y.shape[0]]
    for s in range(b.shape[0]):
        rows = (slots == s).nonzero().squeeze(1)
        if not rows.numel():
            continue
        for j in range(len(offsets) - 1):
            lo, hi = offsets[j], offsets[j + 1]
            delta = t[rows, j].to(b.dtype).float() @ b[s, lo:hi].float().t()
            y[rows, lo:hi] = (y[rows, lo:hi].float() + delta).to(y.dtype)
