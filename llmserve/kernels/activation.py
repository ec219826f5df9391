"""Gated activations for the MLP, in Triton: SiLU (SwiGLU) and tanh-approximated GELU (GeGLU).

PyTorch references: `llmserve.model.layers.silu_and_mul` (`silu(gate) * up`) and
`gelu_tanh_and_mul` (`gelu(gate, approximate="tanh") * up`), where `gate, up = x.chunk(2, dim=-1)`.
Rounded like the references (the activation's result rounded to the input dtype before the
multiply). One kernel serves both, the activation a compile-time choice (`ACT`), so each compiles
to its own code. tanh GELU is taken as `g * sigmoid(2u)` with u = sqrt(2/pi) (g + 0.044715 g^3),
which is `0.5 g (1 + tanh(u))`: one exp, as SiLU's `g * sigmoid(g)`, and no tanh (libdevice's is
not in the Triton interpreter); within a few float32 ulps of torch's.

`silu_and_mul_fp8` (and `gelu_tanh_and_mul_fp8`) also quantizes each row to FP8 per token (the
down projection's input), as `llmserve.model.fp8.quantize_tokens` quantizes the reference's
output: one program per row, holding the row in registers when it fits (ONE_PASS_COLS), else a
first pass for the amax and a second that recomputes, scales and casts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.fp8_tokens import Fp8Tokens
from llmserve.kernels.fp8_quant import FP8_MAX, MIN_SCALE, fp8_reciprocal, fp8_scale, fp8_scaled
from llmserve.kernels.pdl import gdc_enter, launch_options

ACTIVATIONS = ("silu", "gelu_tanh")  # the kernels' ACT

# Launch tuning, all of it (measurements behind the values: docs/history/benchmarks.md)
PLAIN_BLOCK = 1024  # plain kernel: columns a program, at most (wider rows take several programs)
COLS_PER_WARP = 128  # plain kernel: a warp per this many columns of its block, 1 to MAX_WARPS
ONE_PASS_COLS = 16384  # FP8 kernel: longest row held in registers at once (a looped row waits on its loads in turn)
LOOP_BLOCK = 2048  # FP8 kernel: columns per step for longer rows
FP8_COLS_PER_WARP = 256  # FP8 kernel: a warp per this many columns of its block, 1 to MAX_WARPS
FP8_WIDE_BLOCK = 8192  # FP8 kernel: a one-pass row of at least this many columns runs on FP8_WIDE_WARPS
FP8_WIDE_WARPS = 16
MAX_WARPS = 8


def _warps(block: int) -> int:
    """The plain kernel's warps for a block of `block` columns."""
    return max(1, min(MAX_WARPS, block // COLS_PER_WARP))


def _fp8_warps(block: int, one_pass: bool) -> int:
    """The FP8 kernel's warps for a block of `block` columns."""
    if one_pass and block >= FP8_WIDE_BLOCK:
        return FP8_WIDE_WARPS
    return max(1, min(MAX_WARPS, block // FP8_COLS_PER_WARP))


@triton.jit
def _act(gate, ACT: tl.constexpr):
    """ACT of `gate` in float32, rounded to gate's dtype as the reference rounds it (and back)."""
    g = gate.to(tl.float32)
    if ACT == "gelu_tanh":  # g * sigmoid(2u): 2u = 2 sqrt(2/pi) (g + 0.044715 g^3), as torch's inner term
        z = 1.5957691216057308 * (g + 0.044715 * (g * g * g))
    else:
        z = g
    return (g / (1.0 + tl.exp(-z))).to(gate.dtype).to(tl.float32)


@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr, delta_ptr, stride_x, stride_o, stride_d, n_cols, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr,
    ACT: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    if HAS_DELTA:  # x.add_(delta) first: a float32 LoRA delta, rounded back to x's dtype
        d_row = delta_ptr + row * stride_d
        gate = (gate.to(tl.float32) + tl.load(d_row + cols, mask=mask, other=0.0)).to(x_ptr.dtype.element_ty)
        up = (up.to(tl.float32) + tl.load(d_row + n_cols + cols, mask=mask, other=0.0)).to(x_ptr.dtype.element_ty)
    out = _act(gate, ACT) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_mul_row(x_row, cols, mask, n_cols, ACT: tl.constexpr):
    gate = tl.load(x_row + cols, mask=mask, other=0.0)
    up = tl.load(x_row + n_cols + cols, mask=mask, other=0.0)
    return (_act(gate, ACT) * up.to(tl.float32)).to(gate.dtype).to(tl.float32)  # the reference's output, rounded


@triton.jit
def _act_and_mul_fp8_kernel(
    x_ptr, q_ptr, scale_ptr, stride_x, stride_q, n_cols,
    BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, ACT: tl.constexpr,
    USE_GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    if ONE_PASS:  # the whole row in registers (BLOCK >= n_cols): one load, no recompute
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = _act_mul_row(x_row, cols, mask, n_cols, ACT)
        scale = fp8_scale(tl.max(tl.abs(y), axis=0), FP8_MAX, MIN_SCALE)
        q = fp8_scaled(y, fp8_reciprocal(scale), FP8_MAX)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(_act_mul_row(x_row, cols, cols < n_cols, n_cols, ACT)))
        scale = fp8_scale(tl.max(amax, axis=0), FP8_MAX, MIN_SCALE)
        inv = fp8_reciprocal(scale)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            q = fp8_scaled(_act_mul_row(x_row, cols, mask, n_cols, ACT), inv, FP8_MAX)
            tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def silu_and_mul_fp8(x: torch.Tensor) -> Fp8Tokens:
    """x `[..., 2 * I]` -> `silu_and_mul(x)` as FP8 rows `[T, I]` with a scale per row."""
    return _act_and_mul_fp8(x, "silu")


def gelu_tanh_and_mul_fp8(x: torch.Tensor) -> Fp8Tokens:
    """x `[..., 2 * I]` -> `gelu_tanh_and_mul(x)` as FP8 rows `[T, I]` with a scale per row."""
    return _act_and_mul_fp8(x, "gelu_tanh")


def _act_and_mul_fp8(x: torch.Tensor, act: str) -> Fp8Tokens:
    assert act in ACTIVATIONS, act
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    # FP8 on a GPU; float32 under the interpreter, whose FP8 cast is wrong (torch casts)
    q = torch.empty((rows, inter), dtype=torch.float8_e4m3fn if x.is_cuda else torch.float32, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows and inter:
        one_pass = inter <= ONE_PASS_COLS
        block = triton.next_power_of_2(inter) if one_pass else LOOP_BLOCK
        _act_and_mul_fp8_kernel[(rows,)](
            x2, q, scale, x2.stride(0), q.stride(0), inter, BLOCK=block, ONE_PASS=one_pass, FP8_MAX=FP8_MAX,
            MIN_SCALE=MIN_SCALE, ACT=act, num_warps=_fp8_warps(block, one_pass),
            **launch_options(x.device),
        )  # fmt: skip
    return Fp8Tokens(q.to(torch.float8_e4m3fn), scale, x.dtype)


def silu_and_mul(x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """x `[..., 2 * I]` -> `[..., I]`. `delta` (float32, x's shape): added to x first, as
    `x.add_(delta)` would (a LoRA layer's deferred delta: llmserve/lora/deferred.py)."""
    return _act_and_mul(x, delta, "silu")


def gelu_tanh_and_mul(x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """x `[..., 2 * I]` -> `[..., I]`, tanh GELU of the gate times up (Gemma's GeGLU); `delta` as
    `silu_and_mul`'s."""
    return _act_and_mul(x, delta, "gelu_tanh")


def _act_and_mul(x: torch.Tensor, delta: torch.Tensor | None, act: str) -> torch.Tensor:
    assert act in ACTIVATIONS, act
    two_i = x.shape[-1]
    assert two_i % 2 == 0
    inter = two_i // 2
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    d2 = x2
    if delta is not None:
        assert delta.dtype == torch.float32 and delta.shape == x.shape, (delta.dtype, delta.shape)
        d2 = delta.reshape(-1, two_i)
        if d2.stride(-1) != 1:
            d2 = d2.contiguous()
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, inter)
    rows = x2.shape[0]
    if rows and inter:
        block = min(PLAIN_BLOCK, triton.next_power_of_2(inter))
        _act_and_mul_kernel[(rows, triton.cdiv(inter, block))](
            x2, out2, d2, x2.stride(0), out2.stride(0), d2.stride(0), inter, BLOCK=block, HAS_DELTA=delta is not None,
            ACT=act, num_warps=_warps(block), **launch_options(x.device),
        )  # fmt: skip
    return out
