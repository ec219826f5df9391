"""Fused RMSNorm (optionally with the residual add) in Triton.

PyTorch reference: `llmserve.model.layers.RMSNorm.forward`. Same op order, so results
match it bit for bit up to the fp32 reduction order:
    x = x + residual            (in the inputs' dtype; also returned as the new residual)
    h = x.float() * rsqrt(mean(x.float()**2) + eps)
    out = weight * h.to(x.dtype)   (in torch's promoted dtype of weight and x)
One program normalises one row.

With `quantize=True` (FP8 linear layers next) the row is also quantized to FP8 per token,
as `llmserve.model.fp8.quantize_tokens` quantizes the reference's output: the normalised row
rounded to its dtype, its amax, times the scale's correctly rounded reciprocal, saturated at
±448. The FP8 row and its scale are written instead of the normalised row, which saves a
kernel and a pass over the activations before each QKV and gate/up projection.

`qk_rms_norm`: a layer's q and k heads (Qwen3's q_norm and k_norm) in one launch, a program a
head, read through their strides (views of the fused QKV output: no copy first), written to one
buffer [T, Hq + Hk, D] whose two parts are returned.

With a `delta` (float32) the row first becomes `x.add_(delta)`: the LoRA delta of the projection
before, added here instead of in a kernel of its own (llmserve/lora/deferred.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.fp8_tokens import Fp8Tokens
from llmserve.kernels.fp8_quant import FP8_MAX, MIN_SCALE, fp8_reciprocal, fp8_scale, fp8_scaled
from llmserve.kernels.pdl import gdc_enter, launch_options

# Launch tuning, all of it (one program a row, its block the next power of two of its width)
COLS_PER_WARP = 256  # a warp per this many columns of the block, 1 to MAX_WARPS
MAX_WARPS = 16


def _warps(block: int) -> int:
    """Warps for a row block of `block` columns."""
    return min(MAX_WARPS, max(1, block // COLS_PER_WARP))


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, scale_ptr, delta_ptr,
    stride_x, stride_r, stride_o, stride_nr, stride_d,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, QUANTIZE: tl.constexpr, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_DELTA:  # x.add_(delta) first: a float32 LoRA delta, x rounded back to its dtype
        d = tl.load(delta_ptr + row * stride_d + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d).to(x_ptr.dtype.element_ty)
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
    if QUANTIZE:  # weight and x share a dtype here: the reference's output rounded to it
        y = (w * h).to(x.dtype).to(tl.float32)
        scale = fp8_scale(tl.max(tl.abs(y), axis=0), FP8_MAX, MIN_SCALE)
        tl.store(scale_ptr + row, scale)
        q = fp8_scaled(y, fp8_reciprocal(scale), FP8_MAX)
        tl.store(out_ptr + row * stride_o + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + row * stride_o + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x, residual, weight, eps, quantize: bool = False, delta: torch.Tensor | None = None):
    hidden = x.shape[-1]
    x2 = _rows(x)
    sum_dtype = torch.result_type(x, residual) if residual is not None else x.dtype
    out_dtype = torch.promote_types(weight.dtype, sum_dtype)
    scale = None
    if quantize:  # FP8 rows (float32 under the interpreter, whose FP8 cast is wrong: torch casts)
        assert weight.dtype == sum_dtype, "the fused quantization needs weight and activations in one dtype"
        out_dtype = torch.float8_e4m3fn if x.is_cuda else torch.float32
        scale = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x.device)
    out = torch.empty(x2.shape if quantize else x.shape, dtype=out_dtype, device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        r2 = _rows(residual)
        new_res = torch.empty(x.shape, dtype=sum_dtype, device=x.device)
        nr2 = new_res.view(-1, hidden)
    else:
        r2 = nr2 = x2
        new_res = None
    rows = x2.shape[0]
    d2 = x2
    if delta is not None:
        assert delta.dtype == torch.float32 and delta.shape == x.shape, (delta.dtype, delta.shape)
        d2 = _rows(delta)
    if rows:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out2, nr2, scale if quantize else out2, d2,
            x2.stride(0), r2.stride(0), out2.stride(0), nr2.stride(0), d2.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, QUANTIZE=quantize, HAS_DELTA=delta is not None, BLOCK=block,
            FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, num_warps=_warps(block), **launch_options(x.device),
        )  # fmt: skip
    if quantize:
        return Fp8Tokens(out.to(torch.float8_e4m3fn), scale, sum_dtype), new_res
    return out, new_res


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of `x` (any leading shape)."""
    assert weight.is_contiguous() and weight.shape[-1] == x.shape[-1]
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(RMSNorm(x + residual), x + residual)` in one pass (new tensors; inputs untouched).
    `delta` (float32, x's shape): added to x first, as `x.add_(delta)` would (a LoRA layer's
    deferred delta: llmserve/lora/deferred.py)."""
    assert weight.is_contiguous() and weight.shape[-1] == x.shape[-1]
    assert residual.shape == x.shape
    out, new_res = _launch(x, residual, weight, eps, delta=delta)
    return out, new_res


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Tokens:
    """`rms_norm` quantized to FP8 per token in the same pass (rows flattened)."""
    assert weight.is_contiguous() and weight.shape[-1] == x.shape[-1]
    return _launch(x, None, weight, eps, quantize=True)[0]


def fused_add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[Fp8Tokens, torch.Tensor]:
    """`fused_add_rms_norm` with the normalised rows quantized to FP8 per token."""
    assert weight.is_contiguous() and weight.shape[-1] == x.shape[-1]
    assert residual.shape == x.shape
    return _launch(x, residual, weight, eps, quantize=True)


@triton.jit
def _qk_rms_norm_kernel(
    q_ptr, k_ptr, qw_ptr, kw_ptr, out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    n_q, n_heads, n_cols, eps,
    BLOCK: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)  # (token, head) of the n_heads = Hq + Hk heads a token
    t = row // n_heads
    h = row % n_heads
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if h < n_q:
        x = tl.load(q_ptr + t * stride_qt + h * stride_qh + cols, mask=mask, other=0.0)
        w = tl.load(qw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(k_ptr + t * stride_kt + (h - n_q) * stride_kh + cols, mask=mask, other=0.0)
        w = tl.load(kw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    hx = x.to(tl.float32)
    var = tl.sum(hx * hx, axis=0) / n_cols
    hx = (hx * tl.math.rsqrt(var + eps)).to(x.dtype).to(tl.float32)  # the reference's `h.to(dtype)`
    tl.store(out_ptr + row * n_cols + cols, (w * hx).to(out_ptr.dtype.element_ty), mask=mask)


def qk_rms_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`llmserve.model.layers.qk_rms_norm` in one launch: q [T, Hq, D] and k [T, Hk, D] (any token and
    head strides, unit stride in D) -> their normalised heads, views of one [T, Hq + Hk, D] buffer."""
    num_tokens, n_q, d = q.shape
    n_k = k.shape[1]
    assert k.shape[0] == num_tokens and k.shape[2] == d and q.stride(-1) == 1 and k.stride(-1) == 1, (q.shape, k.shape)
    assert q_weight.is_contiguous() and k_weight.is_contiguous() and q_weight.dtype == k_weight.dtype
    out_dtype = torch.promote_types(q_weight.dtype, q.dtype)
    out = torch.empty((num_tokens, n_q + n_k, d), dtype=out_dtype, device=q.device)
    if num_tokens:
        block = triton.next_power_of_2(d)
        _qk_rms_norm_kernel[(num_tokens * (n_q + n_k),)](
            q, k, q_weight, k_weight, out, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            n_q, n_q + n_k, d, eps, BLOCK=block, num_warps=_warps(block), **launch_options(q.device),
        )  # fmt: skip
    return out[:, :n_q], out[:, n_q:]
