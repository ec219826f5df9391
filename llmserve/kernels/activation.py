"""Gated SiLU for the MLP, in Triton.

PyTorch reference: `llmserve.model.layers.silu_and_mul`: `silu(gate) * up` where
`gate, up = x.chunk(2, dim=-1)`. Rounded like the reference (silu's result rounded to the
input dtype before the multiply).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    out = act * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x `[..., 2 * I]` -> `[..., I]`."""
    two_i = x.shape[-1]
    assert two_i % 2 == 0
    inter = two_i // 2
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, inter)
    rows = x2.shape[0]
    if rows and inter:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](
            x2, out2, x2.stride(0), out2.stride(0), inter, BLOCK=block,
            num_warps=max(1, min(8, block // 128)),
        )  # fmt: skip
    return out
