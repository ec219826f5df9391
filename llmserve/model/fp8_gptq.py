"""Error-compensating rounding of a weight matrix onto the FP8 E4M3 grid (GPTQ; Frantar et al.,
"GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers", 2022).

Round-to-nearest (`fp8.quantize_rows`) rounds every weight on its own. GPTQ rounds a layer's
weight [rows, cols] one input column at a time and moves each column's rounding error onto the
columns not yet rounded, weighted by the inverse of the Hessian H = 2 X^T X of the layer's
inputs X (calibration activations [tokens, cols]). This minimises the layer's output error
||X W^T - X Q^T|| greedily instead of the weights' own error; where inputs are correlated, the
error of one column is largely cancelled by the next ones.

Here the grid is what `--quantization fp8` stores: E4M3 with one float32 scale per output row,
scale = row absmax / 448, fixed from the unrounded weight before GPTQ runs; the values moved by
the error feedback are clamped to +-448 before rounding. The result has `quantize_rows`'s form
(FP8 weight, scale [rows, 1]), so a checkpoint writer can store it as it stores RTN weights.

The algorithm, as the paper describes it: dampen H (a fraction of its mean diagonal added to
the diagonal), take the upper Cholesky factor U of H^-1 (row i of U holds, scaled, what the
remaining columns' update after rounding column i needs), then walk blocks of columns: inside a
block, round a column, divide its error by U[i, i] and subtract error x U[i, i+1:] from the
block's later columns; after the block, apply all its errors to the columns after it at once
(the "lazy batch" update, one matrix product). Optionally columns go in order of decreasing
H[i, i] ("act order"), the inputs with the most energy rounded first.
"""

from __future__ import annotations

import torch

from llmserve.model.fp8 import _MIN_SCALE, FP8, FP8_MAX


def input_hessian(x: torch.Tensor) -> torch.Tensor:
    """X^T X of inputs x [..., cols] in float64 (sum over tokens; GPTQ's 2/n factor does not
    change the result). Sum these over calibration batches."""
    x = x.reshape(-1, x.shape[-1]).to(torch.float32)
    return (x.t() @ x).to(torch.float64)


def _round(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w [rows, k] on the E4M3 grid of `scale` [rows, 1], in FP8 units (float32)."""
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).to(torch.float32)


def gptq_fp8(weight: torch.Tensor, hessian: torch.Tensor, damp: float = 0.01, block: int = 128,
             act_order: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`weight` [rows, cols] rounded to E4M3 by GPTQ against `hessian` [cols, cols] (X^T X of the
    layer's inputs, e.g. summed `input_hessian`): (FP8 weight [rows, cols], float32 scale
    [rows, 1]) as `fp8.quantize_rows` returns them, one scale per row (absmax / 448 of
    `weight`). `damp`: the fraction of H's mean diagonal added to its diagonal; `block`: columns
    per lazy batch update; `act_order`: round columns by decreasing H[i, i]. With H a multiple
    of the identity it is round-to-nearest. Computed in float32 (the Hessian's factorisation in
    float64), on the tensors' device."""
    w = weight.detach().to(torch.float32).clone()
    rows, cols = w.shape
    if hessian.shape != (cols, cols):
        raise ValueError(f"Hessian {tuple(hessian.shape)} for a weight of {cols} columns")
    scale = (w.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    h = hessian.detach().to(torch.float64).clone()
    dead = torch.diagonal(h) == 0  # inputs never seen: nothing to compensate with them
    h[dead, dead] = 1.0
    perm = torch.argsort(torch.diagonal(h), descending=True) if act_order else None
    if perm is not None:
        w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.diagonal(h).mean() * torch.eye(cols, dtype=h.dtype, device=h.device)
    # upper Cholesky factor of H^-1: H^-1 = U^T U
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).to(torch.float32)
    q = torch.empty_like(w)
    for b0 in range(0, cols, block):
        b1 = min(b0 + block, cols)
        wb = w[:, b0:b1].clone()
        ub = u[b0:b1, b0:b1]
        errors = torch.empty_like(wb)
        for i in range(b1 - b0):
            col = wb[:, i : i + 1]
            qc = _round(col, scale)
            q[:, b0 + i : b0 + i + 1] = qc
            err = (col - qc * scale) / ub[i, i]
            wb[:, i + 1 :] -= err @ ub[i : i + 1, i + 1 :]
            errors[:, i : i + 1] = err
        w[:, b1:] -= errors @ u[b0:b1, b1:]
    if perm is not None:
        q = q[:, torch.argsort(perm)]
    return q.to(FP8), scale.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 weight with its row scales back in `dtype` (what a fake-quant study multiplies by)."""
    return (q.to(torch.float32) * scale).to(dtype)
