"""Write the new tokens' keys and values into the paged KV cache (Triton).

PyTorch reference: `llmserve.model.attention.write_kv_cache`.

One program per new token copies its `[Hkv, D]` key and value rows into cache slot
`slot_mapping[t]` of `kv_cache[0]` / `kv_cache[1]`; a slot < 0 means "skip" (padding). An FP8
cache stores key / k_scale and value / v_scale (`kv_scales`, one pair per layer), saturated.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.kernels.pdl import gdc_enter, launch_options


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cs, stride_ch, k_inv, v_inv,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8_MAX: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(USE_GDC)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    key = tl.load(k_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    val = tl.load(v_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if FP8_MAX > 0:  # an FP8 cache: divided by the layer's scales, saturated, as the reference does
        key = tl.minimum(tl.maximum(key.to(tl.float32) * k_inv, -FP8_MAX), FP8_MAX)
        val = tl.minimum(tl.maximum(val.to(tl.float32) * v_inv, -FP8_MAX), FP8_MAX)
    dst = slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(k_cache_ptr + dst, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, val.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Scatter k/v `[T, Hkv, D]` into `kv_cache` `[2, num_blocks, block_size, Hkv, D]`
    (an FP8 cache: divided by `kv_scales`, the layer's key and value scales)."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    assert kv_cache.is_contiguous(), "the KV cache must be contiguous"
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if fp8 and not kv_cache.is_cuda:
        # the Triton interpreter (CPU) rounds float -> FP8 wrongly next to powers of two (1.96 -> 1.0):
        # convert with torch and let the kernel copy bytes; a GPU converts in the kernel
        from llmserve.attention_metadata import to_cache_dtype

        k = to_cache_dtype(k, kv_cache.dtype, kv_scales[0]).view(torch.uint8)
        v = to_cache_dtype(v, kv_cache.dtype, kv_scales[1]).view(torch.uint8)
        kv_cache, fp8 = kv_cache.view(torch.uint8), False
    # [2, num_blocks * block_size, Hkv, D]: slot s of keys at flat[0, s]
    flat = kv_cache.view(2, -1, num_heads, head_dim)
    k_cache, v_cache = flat[0], flat[1]
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), 1.0 / kv_scales[0], 1.0 / kv_scales[1],
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        FP8_MAX=448.0 if fp8 else 0.0,
        num_warps=4 if num_heads * head_dim >= 1024 else 1, **launch_options(k.device),
    )  # fmt: skip
