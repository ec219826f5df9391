"""Neox-style rotary position embedding for q and k in one launch, in Triton.

PyTorch reference: `llmserve.model.layers.RotaryEmbedding.forward` (and `_rotate_half`):
    cos, sin = cos_sin[0, pos].to(dtype), cos_sin[1, pos].to(dtype)
    out = x * cos + rotate_half(x) * sin,  rotate_half(x) = cat(-x[D/2:], x[:D/2])
Each product is rounded to the input dtype before the sum, as the reference's 16-bit ops
do. One program handles every head of q and k for one token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.kernels.pdl import gdc_enter, launch_options

# Launch tuning, all of it (one program a token, every head of it)
WIDE_Q_ELEMENTS = 2048  # a token's query heads of at least this many values (n_q_heads * head_dim) are wide
WIDE_WARPS = 4  # warps for a wide token
NARROW_WARPS = 1  # warps for a narrower one


@triton.jit
def _rotate_heads(
    x_ptr, o_ptr, stride_xh, stride_oh, n_heads, c1, c2, s1, s2,
    BLOCK_H: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF_PAD)
    mask = (offs_h[:, None] < n_heads) & (offs_d[None, :] < HALF)
    xp = x_ptr + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(xp, mask=mask, other=0.0)
    x2 = tl.load(xp + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    # first half:  x1 * cos1 + (-x2) * sin1 ; second half: x2 * cos2 + x1 * sin2
    a1 = (f1 * c1[None, :]).to(dt).to(tl.float32)
    b1 = (-f2 * s1[None, :]).to(dt).to(tl.float32)
    a2 = (f2 * c2[None, :]).to(dt).to(tl.float32)
    b2 = (f1 * s2[None, :]).to(dt).to(tl.float32)
    op = o_ptr + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(op, (a1 + b1).to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(op + HALF, (a2 + b2).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cs_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cs0, stride_cs1,
    n_q_heads, n_k_heads,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(USE_GDC)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    dmask = offs_d < HALF
    cp = cs_ptr + pos * stride_cs1 + offs_d
    # the reference casts the table to the activations' dtype first
    dt = q_ptr.dtype.element_ty
    c1 = tl.load(cp, mask=dmask, other=0.0).to(dt).to(tl.float32)
    c2 = tl.load(cp + HALF, mask=dmask, other=0.0).to(dt).to(tl.float32)
    s1 = tl.load(cp + stride_cs0, mask=dmask, other=0.0).to(dt).to(tl.float32)
    s2 = tl.load(cp + stride_cs0 + HALF, mask=dmask, other=0.0).to(dt).to(tl.float32)
    _rotate_heads(
        q_ptr + t * stride_qt, qo_ptr + t * stride_qot, stride_qh, stride_qoh, n_q_heads,
        c1, c2, s1, s2, BLOCK_HQ, HALF, HALF_PAD,
    )  # fmt: skip
    _rotate_heads(
        k_ptr + t * stride_kt, ko_ptr + t * stride_kot, stride_kh, stride_koh, n_k_heads,
        c1, c2, s1, s2, BLOCK_HK, HALF, HALF_PAD,
    )  # fmt: skip


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    *,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[T, Hq, D]`, k `[T, Hk, D]`, positions `[T]`, cos_sin `[2, max_pos, D]`.

    Returns the rotated (q, k): new tensors, or q and k themselves with `inplace=True`.
    """
    num_tokens, n_q, head_dim = q.shape
    n_k = k.shape[1]
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim and head_dim % 2 == 0
    assert cos_sin.shape[0] == 2 and cos_sin.shape[-1] == head_dim and cos_sin.stride(-1) == 1
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        assert not inplace, "in-place rotary needs a unit stride on the last dimension"
        q, k = q.contiguous(), k.contiguous()
    if inplace:
        q_out, k_out = q, k
    else:
        q_out, k_out = (
            torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
        )
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, q_out, k_out, positions, cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_sin.stride(0), cos_sin.stride(1),
        n_q, n_k,
        HALF=half, HALF_PAD=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(n_q), BLOCK_HK=triton.next_power_of_2(n_k),
        num_warps=WIDE_WARPS if n_q * head_dim >= WIDE_Q_ELEMENTS else NARROW_WARPS, **launch_options(q.device),
    )  # fmt: skip
    return q_out, k_out
