"""Activations to FP8 per token in one kernel, for FP8 linear layers.

PyTorch reference: `llmserve.model.fp8.quantize_tokens`. It takes five torch ops (a float32
copy, abs, amax, divide and clamp, the cast), at decode sizes about as long as the FP8 GEMM
after it (docs/history/benchmarks.md). Here one program per
token reads its row twice: once for the amax, once to scale, clamp and cast. Rounding is the
reference's: the scale's reciprocal by the correctly rounded float32 division (`tl.div_rn`:
Triton's `/` compiles to an approximate division on a GPU), once a token, then each value
times it (a correctly rounded multiply on both sides), then round-to-nearest-even to E4M3.
Dividing every value by the scale instead, with `tl.div_rn`, was the bottleneck of the fused
SiLU-and-multiply at prefill sizes (about 1.5x its time with the reciprocal;
docs/history/benchmarks.md); the two differ in about 0.05 % of the bytes, by one step.

The Triton interpreter (CPU) rounds float -> FP8 wrongly next to powers of two, so there the
kernel stores the scaled float32 values and torch casts them; a GPU casts in the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.kernels.pdl import gdc_enter, launch_options

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_SCALE = 1e-12  # the reference's floor: an all-zero token keeps a finite scale

# Launch tuning, all of it (one program a token, looping over its row in blocks)
MAX_BLOCK = 4096  # columns a block, at most (a narrower row: the next power of two of its width)
COLS_PER_WARP = 256  # a warp per this many columns of the block, 1 to MAX_WARPS
MAX_WARPS = 8


def _warps(block: int) -> int:
    """Warps for a block of `block` columns."""
    return max(1, min(MAX_WARPS, block // COLS_PER_WARP))


@triton.jit
def fp8_scale(amax, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """A token's scale from its largest magnitude, rounded as the reference rounds it."""
    return tl.maximum(tl.div_rn(amax, FP8_MAX), MIN_SCALE)


@triton.jit
def fp8_reciprocal(scale):
    """`1 / scale`, correctly rounded (as torch divides): what every value is multiplied by."""
    return tl.div_rn(scale * 0.0 + 1.0, scale)


@triton.jit
def fp8_scaled(v, inv_scale, FP8_MAX: tl.constexpr):
    """`v * (1 / scale)` saturated to the E4M3 range, in float32 (the cast to FP8 follows)."""
    return tl.minimum(tl.maximum(v * inv_scale, -FP8_MAX), FP8_MAX)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, static_ptr, n_cols, stride_x, stride_q,
    HAS_STATIC: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
    USE_GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    if HAS_STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            v = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = fp8_scale(tl.max(amax, axis=0), FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    inv = fp8_reciprocal(scale)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        v = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        q = fp8_scaled(v, inv, FP8_MAX)
        tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_tokens_fp8(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[T, K]` (any float dtype) -> (FP8 `[T, K]`, float32 scales `[T, 1]`), per token, or
    with a checkpoint's static scale: the reference's results, bit for bit."""
    assert x.dim() == 2, "activations are [tokens, features]"
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    on_gpu = x.is_cuda
    q = torch.empty((rows, cols), dtype=FP8 if on_gpu else torch.float32, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows and cols:
        static = static_scale.reshape(1).to(device=x.device, dtype=torch.float32) if static_scale is not None else scale
        block = min(MAX_BLOCK, triton.next_power_of_2(cols))
        _quantize_rows_kernel[(rows,)](
            x, q, scale, static, cols, x.stride(0), q.stride(0),
            HAS_STATIC=static_scale is not None, BLOCK=block, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
            num_warps=_warps(block), **launch_options(x.device),
        )  # fmt: skip
    elif rows and static_scale is not None:
        scale.fill_(float(static_scale.reshape(-1)[0]))
    elif rows:
        scale.fill_(MIN_SCALE)
    if not on_gpu:  # the interpreter's cast is wrong next to powers of two: torch casts
        q = q.to(FP8)
    return q, scale
