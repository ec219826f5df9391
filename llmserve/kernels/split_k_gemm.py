"""A GEMM for few tokens (decode), in Triton: split along K, one launch. Two forms of one kernel:
FP8 operands with row-wise scales (`fp8_gemm_small_m`), and 16-bit operands (`gemm_small_m`,
the bf16 model's projections at batch 1).

PyTorch references: `llmserve.model.fp8.fp8_matmul_reference` (dequantize both, multiply in
float32) and `torch.nn.functional.linear`. At M <= 128 `torch._scaled_mm` read FP8 weights more
slowly than a bf16 GEMM reads bf16 ones, so FP8's halved bytes did not show at decode
(docs/history/benchmarks.md, "FP8 first measured"). With few rows, the weight matrix is read once;
the grid covers N in tiles and K in `split_k` slices, so enough programs stream it. Each
program accumulates `x_tile @ w_tile^T` in float32 (`tl.dot`), applies the two scales (FP8)
and writes its partial sum.

The partial sums are added inside the same launch (a separate sum and cast cost two more
kernels, about 2 µs each at decode): each program counts itself in a per-tile counter after
its store, and the program that arrives last adds the tile's partials in slice order (so the
result is the same on every run, unlike atomic adds of the values), writes the output in its
dtype and resets the counter for the next call. The counters live in a small per-device
workspace that is all zeros between calls (CUDA graphs replay the same addresses).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.kernels.pdl import gdc_enter, launch_options

# Launch tuning, all of it: the tiles are chosen from the shape alone, by the rules below. The
# sweeps behind them: docs/history/benchmarks.md ("FP8 first measured", "FP8 faster than vLLM's FP8",
# "issue 18's table again"), scripts/gpu/fp8_gemm_micro.py, dense_gemm_micro.py, pdl_chain_micro.py.
MAX_M = 64  # rows this kernel is for; more rows: torch._scaled_mm
SMALL_TILE_ROWS = 8  # up to this many rows: the batch-1 tiles of `default_config`
SMALL_M_PROGRAMS = 256  # up to SMALL_TILE_ROWS rows, K is split so that about this many programs stream the weights
PROGRAMS = 512  # more rows: about this many
DEEP_K = 8192  # FP8: a K of at least this (the MLP's down projection) takes 256-deep K steps
WIDE_N = 16384  # an N of at least this (the MLP's gate/up, an LM head): see `default_config`, `bf16_config`
DEEP_TILES_SHARED_MEMORY = 160 * 1024  # a block's shared memory that 128 x 256 FP8 tiles in 3 stages need
NUM_WARPS = 4
BF16_STAGES = 4  # the 16-bit form's narrow tiles (its others: None, Triton's 3)
# the 16-bit form where `bf16_config` has no tiles (more than one token: tests and sweeps)
BF16_UNTUNED = {"block_n": 128, "block_k": 128, "split_k": None, "num_warps": NUM_WARPS, "num_stages": None}


def split_k_for(m: int, k: int, block_k: int, tiles_n: int) -> int:
    """K slices so that about SMALL_M_PROGRAMS programs (up to SMALL_TILE_ROWS rows) or PROGRAMS
    stream the weights."""
    programs = SMALL_M_PROGRAMS if m <= SMALL_TILE_ROWS else PROGRAMS
    return max(1, min(triton.cdiv(k, block_k), programs // tiles_n))


def default_config(m: int, n: int, k: int, deep_tiles: bool = True) -> dict:
    """The FP8 form's tiles. Up to SMALL_TILE_ROWS tokens (batch-1 decode): 128-wide N tiles,
    256-deep K steps for a long K or a wide N (with `deep_tiles` False, where 110 KB of shared
    memory do not fit a block, 128 deep), K split for about SMALL_M_PROGRAMS programs
    (docs/gpu_fp8_gemm_micro_m1_2026-12-01.json). More tokens: 64-wide N tiles, 256-deep K steps
    for a long K, about PROGRAMS programs (docs/gpu_fp8_gemm_micro_sweep_2026-12-01.json)."""
    if m <= SMALL_TILE_ROWS:
        block_n, block_k = 128, (256 if deep_tiles and (k >= DEEP_K or n >= WIDE_N) else 128)
    else:
        block_n, block_k = 64, (256 if k >= DEEP_K else 128)
    return {"block_n": block_n, "block_k": block_k, "split_k": split_k_for(m, k, block_k, triton.cdiv(n, block_n))}


def bf16_config(m: int, n: int, k: int) -> dict | None:
    """The 16-bit form's tiles at one token; None for more (at 2-16 tokens the kernel gained 0-9 %
    over cuBLAS and the best tiles differ by shape). N below WIDE_N (qkv, o, down): 64-wide tiles,
    128-deep K steps, K split for about SMALL_M_PROGRAMS programs, BF16_STAGES stages, each faster
    than cuBLAS. N of WIDE_N and more (the MLP's gate/up, an LM head): 128-wide tiles, K whole,
    Triton's 3 stages; gate/up alone is as fast as cuBLAS, and inside a decode step faster, as it
    starts early under programmatic dependent launch (llmserve/kernels/pdl.py), which cuBLAS's
    kernel cannot."""
    if m != 1:
        return None
    if n >= WIDE_N:
        return {"block_n": 128, "block_k": 128, "split_k": 1, "num_warps": NUM_WARPS, "num_stages": None}
    tiles = triton.cdiv(n, 64)
    return {
        "block_n": 64,
        "block_k": 128,
        "split_k": max(1, min(triton.cdiv(k, 128), triton.cdiv(SMALL_M_PROGRAMS, tiles))),
        "num_warps": NUM_WARPS,
        "num_stages": BF16_STAGES,
    }


_MAX_TILES = 1 << 16  # counters in the workspace: N / block_n tiles of the widest projection
_workspaces: dict[torch.device, torch.Tensor] = {}  # per-device scratch, not state: zero between calls


@triton.jit
def _dot_acc(acc, x, w, DOT_F32: tl.constexpr):
    if DOT_F32:  # the interpreter (CPU): its bfloat16 dot is wrong; float32 products are exact
        return acc + tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee", out_dtype=tl.float32)
    return acc + tl.dot(x, tl.trans(w), out_dtype=tl.float32)


@triton.jit
def _split_k_gemm_kernel(
    x_ptr, w_ptr, sx_ptr, sw_ptr, part_ptr, out_ptr, count_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALED: tl.constexpr, DOT_F32: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    gdc_enter(USE_GDC)
    for k in range(k_start, k_end, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        in_k = ks < k_end
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & in_k[None, :], other=0.0
        )
        w = tl.load(
            w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=(cols[:, None] < N) & in_k[None, :], other=0.0
        )
        acc = _dot_acc(acc, x, w, DOT_F32)
    if SCALED:  # FP8: the tokens' and the weight rows' scales
        sx = tl.load(sx_ptr + rows, mask=rows < M, other=0.0)
        sw = tl.load(sw_ptr + cols, mask=cols < N, other=0.0)
        acc = acc * sx[:, None] * sw[None, :]
    tile_mask = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT_K == 1:
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=tile_mask)
    else:
        tile = rows[:, None] * N + cols[None, :]
        tl.store(part_ptr + pid_k * M * N + tile, acc, mask=tile_mask)
        tl.debug_barrier()  # every thread's store issued before the count (released by the atomic)
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last slice of this tile: add all of them in order
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part_ptr + s * M * N + tile, mask=tile_mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + tile, total.to(out_ptr.dtype.element_ty), mask=tile_mask)
            tl.atomic_xchg(count_ptr + pid_n, 0)  # zero again for the next call


def _counters(device: torch.device) -> torch.Tensor:
    if device not in _workspaces:
        _workspaces[device] = torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)
    return _workspaces[device]


_deep_tiles: dict[torch.device, bool] = {}  # per device: a fact of the hardware, not state


def _deep_tiles_fit(device: torch.device) -> bool:
    """Do 128 x 256 FP8 tiles in 3 stages (about 110 KB of shared memory) fit one block? Yes on
    Hopper (227 KB); not on Ada (99 KB), which has FP8 too. True off the GPU (the interpreter)."""
    if device.type != "cuda":
        return True
    if device not in _deep_tiles:
        props = torch.cuda.get_device_properties(device)
        _deep_tiles[device] = getattr(props, "shared_memory_per_block_optin", 0) >= DEEP_TILES_SHARED_MEMORY
    return _deep_tiles[device]


def fp8_gemm_small_m(xq: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     out_dtype: torch.dtype, split_k: int | None = None, block_n: int | None = None,
                     block_k: int | None = None, num_warps: int = NUM_WARPS) -> torch.Tensor:  # fmt: skip
    """`(xq * sx) @ (weight * weight_scale)^T` for FP8 `xq` [M, K] (M <= MAX_M) with float32
    scales `sx` [M, 1], FP8 `weight` [N, K] with `weight_scale` [N, 1]; returned in `out_dtype`."""
    m, k = xq.shape
    n = weight.shape[0]
    assert m <= MAX_M and weight.shape[1] == k, (xq.shape, weight.shape)
    if xq.stride(-1) != 1:
        xq = xq.contiguous()
    # the interpreter (CPU) rounds float32 -> bfloat16 otherwise than torch: there torch casts
    out = torch.empty((m, n), dtype=out_dtype if xq.is_cuda else torch.float32, device=xq.device)
    if m == 0:
        return out.to(out_dtype)
    auto = default_config(m, n, k, _deep_tiles_fit(xq.device))
    _launch(xq, weight, sx.reshape(-1).contiguous(), weight_scale.reshape(-1).contiguous(), out,
            block_n or auto["block_n"], block_k or auto["block_k"], split_k, num_warps)  # fmt: skip
    return out.to(out_dtype)


def _launch(x: torch.Tensor, weight: torch.Tensor, sx: torch.Tensor | None, sw: torch.Tensor | None,
            out: torch.Tensor, block_n: int, block_k: int, split_k: int | None, num_warps: int,
            num_stages: int | None = None) -> None:  # fmt: skip
    m, k = x.shape
    n = weight.shape[0]
    tiles_n = triton.cdiv(n, block_n)
    assert tiles_n <= _MAX_TILES
    if split_k is None:
        split_k = split_k_for(m, k, block_k, tiles_n)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    partials = torch.empty((split_k, m, n) if split_k > 1 else (1,), dtype=torch.float32, device=x.device)
    scaled = sx is not None
    extra = {} if num_stages is None else {"num_stages": num_stages}
    _split_k_gemm_kernel[(tiles_n, split_k)](
        x, weight, sx if scaled else partials, sw if scaled else partials, partials, out,
        _counters(x.device), m, n, k, k_per_split, x.stride(0), weight.stride(0),
        SPLIT_K=split_k, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
        SCALED=scaled, DOT_F32=not x.is_cuda and not scaled,
        num_warps=num_warps, **extra, **launch_options(x.device),
    )  # fmt: skip


def gemm_small_m(x: torch.Tensor, weight: torch.Tensor, split_k: int | None = None, block_n: int | None = None,
                 block_k: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None) -> torch.Tensor:  # fmt: skip
    """`x @ weight^T` (`F.linear` without a bias) for 16-bit `x` [M, K] (M <= MAX_M) and `weight`
    [N, K] of the same dtype: float32 accumulation, one rounding to x's dtype at the end."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_M and weight.shape[1] == k and weight.dtype == x.dtype, (x.shape, weight.shape, weight.dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    # the interpreter (CPU) rounds float32 -> bfloat16 otherwise than torch: there torch casts
    out = torch.empty((m, n), dtype=x.dtype if x.is_cuda else torch.float32, device=x.device)
    if m == 0:
        return out.to(x.dtype)
    auto = bf16_config(m, n, k) or BF16_UNTUNED
    _launch(x, weight, None, None, out, block_n or auto["block_n"], block_k or auto["block_k"],
            split_k if split_k is not None else auto["split_k"], num_warps or auto["num_warps"],
            num_stages if num_stages is not None else auto["num_stages"])  # fmt: skip
    return out.to(x.dtype)
