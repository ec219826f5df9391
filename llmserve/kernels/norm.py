"""Fused RMSNorm (optionally with the residual add) in Triton.

PyTorch reference: `llmserve.model.layers.RMSNorm.forward`. Same op order, so results
match it bit for bit up to the fp32 reduction order:
    x = x + residual            (in the inputs' dtype; also returned as the new residual)
    h = x.float() * rsqrt(mean(x.float()**2) + eps)
    out = weight * h.to(x.dtype)   (in torch's promoted dtype of weight and x)
One program normalises one row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    stride_x, stride_r, stride_o, stride_nr,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # the sum is rounded to the residual dtype first, exactly like `x + residual`
        x = (x.to(tl.float32) + r.to(tl.float32)).to(new_res_ptr.dtype.element_ty)
        tl.store(new_res_ptr + row * stride_nr + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n_cols
    h = h * tl.math.rsqrt(var + eps)
    h = h.to(x.dtype).to(tl.float32)  # the reference's `h.to(dtype)` before the weight
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x, residual, weight, eps):
    hidden = x.shape[-1]
    x2 = _rows(x)
    sum_dtype = torch.result_type(x, residual) if residual is not None else x.dtype
    out_dtype = torch.promote_types(weight.dtype, sum_dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        r2 = _rows(residual)
        new_res = torch.empty(x.shape, dtype=sum_dtype, device=x.device)
        nr2 = new_res.view(-1, hidden)
    else:
        r2 = nr2 = x2
        new_res = None
    rows = x2.shape[0]
    if rows:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out2, nr2,
            x2.stride(0), r2.stride(0), out2.stride(0), nr2.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )  # fmt: skip
    return out, new_res


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of `x` (any leading shape)."""
    assert weight.is_contiguous() and weight.shape[-1] == x.shape[-1]
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(RMSNorm(x + residual), x + residual)` in one pass (new tensors; inputs untouched)."""
    assert weight.is_contiguous() and weight.shape[-1] == x.shape[-1]
    assert residual.shape == x.shape
    out, new_res = _launch(x, residual, weight, eps)
    return out, new_res
