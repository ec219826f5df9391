"""Paged attention over a flat varlen batch (decodes and prefill chunks mixed), in Triton.

PyTorch reference: `llmserve.model.attention.reference_paged_attention` (same signature,
same semantics); `triton_paged_attention` is a drop-in `AttentionBackend`.

Layout (see `llmserve/model/attention.py`): q `[T, Hq, D]`, k/v `[T, Hkv, D]`, KV cache
`[2, num_blocks, block_size, Hkv, D]`, block tables `[B, max_blocks]`. Sequence i's new
tokens are `q[qsl[i]:qsl[i+1]]` at positions `seq_len - query_len .. seq_len - 1`; the query
at position p attends to keys 0..p (prefill chunks after a prefix-cache hit included), or with
a sliding `window` W to keys p - W + 1..p only.

How the kernel is organised
---------------------------
* One kernel, `_paged_attn_kernel`, serves every batch. A program owns one *tile*: up to
  BLOCK_Q consecutive new tokens of one sequence x all the query heads that share one KV
  head (the GQA group, padded to a power of two). Rows of the `tl.dot` M dimension are
  (token, head-in-group) pairs, so each KV block is loaded once per group and the tensor
  cores see M >= 16 even for a single decode token (a group of 4 heads pads to 16 rows).
* Two launch shapes of that kernel, picked from `max_query_len`:
  - decode-like batches (every query_len <= BLOCK_Q of a 16-row tile): one tile per
    sequence, grid `(B, Hkv, num_splits)`;
  - batches with longer prefill chunks: BLOCK_M = 64..128 rows; tiles of all sequences
    are laid out in one flat grid axis of `T // BLOCK_Q + B` slots; a program finds its
    sequence by binary search over `qsl[i] // BLOCK_Q + i` (slots past a sequence's last
    tile exit at once).
* The key loop is split in two: blocks entirely below the tile's first query position need
  no causal mask; the rest are masked (causal and `< seq_len`).
* Sliding window (`window=`, the kernel's SLIDING variant; None compiles the code above
  unchanged): the loop starts at the block of the first key in the window of the tile's first
  query, so a tile reads about W + BLOCK_Q keys whatever the context; the blocks before the
  window start of the tile's last query are masked too (a third range, in front). Split-KV
  shares that window, and the split count is chosen by it. SDPA's causal paths are not taken
  (`triton_paged_attention`).
* Split-KV (flash-decoding): with `num_splits > 1`, program `s` of a tile covers the s-th
  share of the tile's key range, writes its normalised partial output and log-sum-exp
  (base 2) to fp32 scratch, and `_reduce_splits_kernel` combines the shares. An empty
  share writes lse = -inf and weighs nothing.
* Online softmax in fp32 (exp2 with log2(e) folded into the scale); fp32 inputs use IEEE
  dots (no TF32) so results match the reference to ~1e-5.

The number of splits is chosen by `choose_num_splits` (see there) from host-side numbers
only (batch size, KV heads, `meta.max_seq_len`, SM count); pass `num_splits=` to force it.
No launch reads device data on the host, so a call can be captured in a CUDA graph; the
split count used at capture is baked in, and stays correct at replay for any sequence
lengths because each program derives its key range from `seq_lens` on the device.
Tile shapes per launch shape (and per grid size for decode) are the `_*_GPU` configs of the
launch-tuning block at the top of this module; `config=` overrides them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmserve.attention_metadata import FP8_KV, AttentionMetadata
from llmserve.kernels.cache_write import write_kv
from llmserve.kernels.fresh_prefill import fresh_prefill_attention
from llmserve.kernels.pdl import gdc_enter, launch_options

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttnLaunchConfig:
    """Tile shape and compiler knobs for one launch shape (decode-like or prefill)."""

    block_m: int  # rows of (token, head-in-group) per program
    block_n: int  # keys per inner iteration (spans block_n / page pages)
    num_warps: int
    num_stages: int


# Launch tuning, all of it. The sweeps behind the values (bf16, 32/8 heads, head dim 128, block 16;
# scripts/gpu/bench_kernels.py) are in docs/history/benchmarks.md: "Triton kernels", "mixed-step
# attention", "issue 18's table again", "issue 18 again — later chunks by SDPA".
# -- tiles
# decode-like launches: 128-key steps at small and medium grids; from _DECODE_LARGE_PROGRAMS_PER_SM
# programs per SM on, 64-key steps with 2 stages
_DECODE_GPU = AttnLaunchConfig(block_m=16, block_n=128, num_warps=4, num_stages=3)
_DECODE_GPU_LARGE = AttnLaunchConfig(block_m=16, block_n=64, num_warps=4, num_stages=2)
_DECODE_LARGE_PROGRAMS_PER_SM = 8
# prefill launches: 128 x 32 tiles with 4 warps (faster than 128 x 64 with 8)
_PREFILL_GPU = AttnLaunchConfig(block_m=128, block_n=32, num_warps=4, num_stages=3)
# long prompts (queries of LONG_PREFILL_TOKENS and more on average, where `long_tiles_fit`): 256 x 64
# tiles with 8 warps, 14-18 % faster than the above from 7,680 tokens up, a later chunk of a long
# prompt included
_PREFILL_GPU_LONG = AttnLaunchConfig(block_m=256, block_n=64, num_warps=8, num_stages=3)
LONG_PREFILL_TOKENS = 4096
# the interpreter (a CPU): small tiles
_DECODE_CPU = AttnLaunchConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)
_PREFILL_CPU = AttnLaunchConfig(block_m=32, block_n=16, num_warps=1, num_stages=1)
# -- split-KV (choose_num_splits)
DEFAULT_NUM_SMS = 132  # the SM count assumed off a GPU (on one, the device's own count is read)
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 32
PROGRAMS_PER_SM_TARGET = 2
# -- which launches and which paths a batch takes
# a mixed batch led by this many decodes runs them in their own launch (paged_attention_forward):
# under 64 decodes the second launch costs more than it saves
MIN_DECODES_TO_SPLIT = 64
# one sequence with no cached context and at least this many new tokens: torch's SDPA (cuDNN,
# else flash) on the new tokens' own q/k/v
SDPA_PREFILL_TOKENS = 2048
# fresh prompts from this many tokens up to SDPA_PREFILL_TOKENS: `fresh_prefill_attention` over their
# own q/k/v, 1.4-1.6x the paged kernel at 512-2,048 tokens (kernels/fresh_prefill.py)
FRESH_KERNEL_TOKENS = 512
# cuDNN's causal attention over the kernel's, both in query-key pairs a second, at long chunks (a
# fresh 16,384-token prompt, and the second 16,384-token chunk of a 32k prompt against the long
# tiles); `pad_front_pays` weighs a chunk's front padding with it
SDPA_SPEEDUP = 1.5
# and a later chunk's whole sequence at least this long: shorter ones (2,048 after 2,048, 4,096 after
# 1,024) were faster in the kernel; from there on the rule above held (bench_kernels.py --only chunks)
SDPA_CHUNK_MIN_TOKENS = 5120


@triton.jit
def _attend_range(
    acc, l_i, m_i, q,
    k_cache_ptr, v_cache_ptr, bt_row_ptr,
    kv_lo, kv_hi, kv_end, qpos, window, head_off, offs_n, offs_d,
    stride_cb, stride_cs, qk_scale,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, MASKED: tl.constexpr, SLIDING: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Online-softmax accumulation over keys [kv_lo, kv_hi) (BLOCK_N-aligned kv_lo).

    MASKED=False: the caller guarantees every key in range is visible to every row (inside its
    window too). MASKED with SLIDING: a row at qpos sees keys in (qpos - window, qpos] only.
    """
    d_ok = offs_d < HEAD_DIM
    for start in range(kv_lo, kv_hi, BLOCK_N):
        n = start + offs_n
        if MASKED:
            n_ok = n < kv_end
            page = tl.load(bt_row_ptr + n // PAGE, mask=n_ok, other=0)
        else:
            page = tl.load(bt_row_ptr + n // PAGE)
        row_off = page.to(tl.int64) * stride_cb + (n % PAGE) * stride_cs + head_off  # [BN]
        if MASKED:
            k = tl.load(
                k_cache_ptr + row_off[None, :] + offs_d[:, None],
                mask=n_ok[None, :] & d_ok[:, None],
                other=0.0,
            )  # [D, BN]
        elif HEAD_DIM_PAD != HEAD_DIM:
            k = tl.load(k_cache_ptr + row_off[None, :] + offs_d[:, None], mask=d_ok[:, None], other=0.0)
        else:
            k = tl.load(k_cache_ptr + row_off[None, :] + offs_d[:, None])
        k = k.to(q.dtype)  # an FP8 cache is read back in the queries' dtype (a no-op otherwise)
        s = tl.dot(q, k, input_precision=DOT_PREC) * qk_scale  # [BM, BN], log2 domain
        if MASKED:
            visible = (n[None, :] <= qpos[:, None]) & n_ok[None, :]
            if SLIDING:
                visible = visible & (n[None, :] > qpos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            # a row with nothing visible yet keeps m = -inf: subtract 0 instead (no NaN)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(
                v_cache_ptr + row_off[:, None] + offs_d[None, :],
                mask=n_ok[:, None] & d_ok[None, :],
                other=0.0,
            )  # [BN, D]
        elif HEAD_DIM_PAD != HEAD_DIM:
            v = tl.load(v_cache_ptr + row_off[:, None] + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        else:
            v = tl.load(v_cache_ptr + row_off[:, None] + offs_d[None, :])
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["seq0", "num_seqs", "window"])
def _paged_attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    qsl_ptr, seq_lens_ptr, bt_ptr,
    seq0, num_seqs, qk_scale, v_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    ONE_TILE_PER_SEQ: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F16: tl.constexpr, SLIDING: tl.constexpr,
    USE_GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(USE_GDC)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # this launch covers sequences seq0 .. seq0 + num_seqs - 1 of the batch (an int, not a
    # sliced pointer: a pointer's alignment is part of the compiled variant)
    qsl_ptr += seq0
    seq_lens_ptr += seq0
    bt_ptr += seq0.to(tl.int64) * stride_bt
    q0 = tl.load(qsl_ptr)  # this launch's first token (split scratch rows count from it)

    # -- which sequence and which of its tiles ----------------------------------------
    if ONE_TILE_PER_SEQ:
        seq = pid
        tile_start = 0
    else:
        # largest i with first_slot(i) = (qsl[i] - qsl[0]) // BLOCK_Q + i <= pid (non-decreasing
        # in i); qsl[0] is 0 unless this launch covers a later part of the batch
        lo = pid * 0
        hi = num_seqs - 1 + pid * 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            first = (tl.load(qsl_ptr + mid) - q0) // BLOCK_Q + mid
            go_up = first <= pid
            lo = tl.where(go_up, mid, lo)
            hi = tl.where(go_up, hi, mid - 1)
        seq = lo
        tile_start = (pid - ((tl.load(qsl_ptr + seq) - q0) // BLOCK_Q + seq)) * BLOCK_Q
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if tile_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len + tile_start  # position of the tile's first query
    tile_len = tl.minimum(q_len - tile_start, BLOCK_Q)
    kv_end = first_pos + tile_len  # keys [0, kv_end) are visible to some row

    # -- rows: (token, head in group) -------------------------------------------------
    offs_m = tl.arange(0, BLOCK_M)
    qi = offs_m // GROUP_PAD
    g = offs_m % GROUP_PAD
    row_ok = (qi < tile_len) & (g < GROUP)
    tok = q_start + tile_start + qi
    head = kvh * GROUP + g
    qpos = first_pos + qi
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )  # fmt: skip
    # DOT_F16 (an FP8 cache under bfloat16 queries): the dots run in float16, the queries cast to it
    # and clamped to its range, the keys and values read back as float16 (`k.to(q.dtype)` in
    # _attend_range): FP8 -> float16 conversion is cheap, FP8 -> bfloat16 made the FP8 cache slower
    # than a bf16 one, and float16 keeps more of the mantissa
    if DOT_F16:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    # -- this program's share of the keys ---------------------------------------------
    kv_start = 0
    if SLIDING:  # from the block of the first key in the window of the tile's first query
        kv_start = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
    if NUM_SPLITS == 1:
        lo_kv = kv_start
        hi_kv = kv_end
    else:
        n_blocks = tl.cdiv(kv_end - kv_start, BLOCK_N)
        per_split = tl.cdiv(n_blocks, NUM_SPLITS) * BLOCK_N
        lo_kv = kv_start + split * per_split
        hi_kv = tl.minimum(lo_kv + per_split, kv_end)
    # blocks fully at or below first_pos are visible to every row: no mask there
    nomask_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    mid_kv = tl.maximum(tl.minimum(nomask_end, hi_kv), lo_kv)
    if SLIDING:  # ... and only from the first block inside the last query's window: masked before it
        last_start = tl.maximum(first_pos + tile_len - window, 0)  # its first key
        window_end = tl.minimum(tl.cdiv(last_start, BLOCK_N) * BLOCK_N, nomask_end)
        nomask_lo = tl.minimum(tl.maximum(window_end, lo_kv), mid_kv)
    else:
        nomask_lo = lo_kv

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt
    head_off = kvh * stride_ch
    if SLIDING:
        acc, l_i, m_i = _attend_range(
            acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row_ptr,
            lo_kv, nomask_lo, kv_end, qpos, window, head_off, offs_n, offs_d,
            stride_cb, stride_cs, qk_scale,
            PAGE, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, True, SLIDING, DOT_PREC,
        )  # fmt: skip
    acc, l_i, m_i = _attend_range(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row_ptr,
        nomask_lo, mid_kv, kv_end, qpos, window, head_off, offs_n, offs_d,
        stride_cb, stride_cs, qk_scale,
        PAGE, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, False, SLIDING, DOT_PREC,
    )  # fmt: skip
    acc, l_i, m_i = _attend_range(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row_ptr,
        mid_kv, hi_kv, kv_end, qpos, window, head_off, offs_n, offs_d,
        stride_cb, stride_cs, qk_scale,
        PAGE, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, True, SLIDING, DOT_PREC,
    )  # fmt: skip

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    result = acc / l_safe[:, None] * v_scale  # an FP8 cache's value scale (1 otherwise)
    store_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        tok64 = (tok - q0).to(tl.int64)  # scratch rows are Hq * splits * D wide: 64-bit offsets
        p_ptrs = (
            part_out_ptr + tok64[:, None] * stride_pt + head[:, None] * stride_ph
            + split * stride_ps + offs_d[None, :]
        )  # fmt: skip
        tl.store(p_ptrs, result, mask=store_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(part_lse_ptr + tok64 * stride_lt + head * stride_lh + split, lse, mask=row_ok)


@triton.jit(do_not_specialize=["seq0", "num_seqs"])
def _reduce_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, qsl_ptr, seq0, num_seqs,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(USE_GDC)
    t = tl.program_id(0)  # scratch row; the output row is t + qsl[seq0]
    h = tl.program_id(1)
    q0 = tl.load(qsl_ptr + seq0)
    if t + q0 >= tl.load(qsl_ptr + seq0 + num_seqs):  # padding rows past the last sequence were never written
        return
    t = t.to(tl.int64)
    t_out = t + q0
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_ok = offs_s < NUM_SPLITS
    lse = tl.load(part_lse_ptr + t * stride_lt + h * stride_lh + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # empty shares: exp2(-inf) = 0
    parts = tl.load(
        part_out_ptr + t * stride_pt + h * stride_ph + offs_s[:, None] * stride_ps
        + offs_d[None, :],
        mask=s_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0,
    )  # fmt: skip
    # an empty share's partial row is 0 (never NaN), so 0 * w is safe
    parts = tl.where(w[:, None] > 0.0, parts, 0.0)
    total = tl.sum(w, 0)
    total = tl.where(total == 0.0, 1.0, total)
    o = tl.sum(parts * w[:, None], 0) / total
    tl.store(
        out_ptr + t_out * stride_ot + h * stride_oh + offs_d,
        o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM,
    )  # fmt: skip


# -- launch configuration ----------------------------------------------------------------


def long_tiles_fit(dtype: torch.dtype, head_dim_pad: int) -> bool:
    """The long tiles were sized for 16-bit queries of head dim 128: their shared memory grows with
    both. In float32 at 128 they ask for 263,680 bytes of shared memory, more than the 232,448 a
    block may have on Hopper GPUs (the warm-up's compile fails); 16-bit at 256 would ask as much.
    Those take the 128 x 32 tiles."""
    return dtype.itemsize * head_dim_pad <= 2 * 128


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def choose_num_splits(
    num_tiles: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int = DEFAULT_NUM_SMS,
    *,
    min_tokens_per_split: int | None = None,
    max_splits: int | None = None,
) -> int:
    """How many programs share one tile's keys (flash-decoding), from host-side numbers only.

    The unsplit grid has `num_tiles x num_kv_heads` programs. If that already gives every SM
    a program, splitting only adds the reduce pass: 1. Otherwise split until about
    PROGRAMS_PER_SM_TARGET programs per SM, but never into shares shorter than
    `min_tokens_per_split` keys (the partial write and the reduce would then cost more than
    the parallelism wins) and never more than `max_splits`.
    """
    programs = max(1, num_tiles * num_kv_heads)
    if programs >= num_sms:
        return 1
    min_tokens_per_split = min_tokens_per_split or MIN_TOKENS_PER_SPLIT  # (read now: kernels/tuning.py)
    max_splits = max_splits or MAX_SPLITS
    by_parallelism = PROGRAMS_PER_SM_TARGET * num_sms // programs
    by_length = max_seq_len // min_tokens_per_split
    splits = max(1, min(by_parallelism, by_length, max_splits))
    # a power of two: NUM_SPLITS is a compile-time constant, so this bounds the kernel
    # variants to a handful that `warmup_paged_attention` compiles before serving
    return 1 << (splits.bit_length() - 1)


def split_counts(max_splits: int = MAX_SPLITS) -> list[int]:
    """Every split count `choose_num_splits` can return."""
    return [1 << i for i in range(max_splits.bit_length()) if 1 << i <= max_splits]


def warmup_paged_attention(
    num_heads: int, kv_cache: torch.Tensor, scale: float, max_batch: int, dtype: torch.dtype,
    submit: Callable[[Callable[[], object]], object] | None = None, window: int | None = None,
) -> int:  # fmt: skip
    """Compile every launch variant (decode and prefill tiles, each split count) now, so
    no request waits for the JIT later. Reads the cache, writes nothing to it. Each launch is
    handed to `submit` (engine/warmup_pool.py: on threads, so the compiles overlap; None: run
    at once). A `window` compiles the sliding-window variants instead (any window size: once
    for a model with sliding layers). Returns the number of launches."""
    submit = submit or (lambda unit: unit())
    _, num_blocks, page, _, head_dim = kv_cache.shape
    device = kv_cache.device
    seq_len = min(num_blocks * page, MIN_TOKENS_PER_SPLIT * MAX_SPLITS)
    blocks = torch.arange(-(-seq_len // page), dtype=torch.int32, device=device) % num_blocks
    launches = 0
    for batch, query_len in ((1, 1), (max_batch, 1), (1, 128)):
        num_tokens = batch * query_len
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=device),
            query_start_loc=torch.arange(0, num_tokens + 1, query_len, dtype=torch.int32, device=device),
            seq_lens=torch.full((batch,), seq_len, dtype=torch.int32, device=device),
            block_tables=blocks.repeat(batch, 1),
            max_query_len=query_len,
            max_seq_len=seq_len,
        )
        q = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
        for splits in split_counts():
            submit(functools.partial(paged_attention_forward, q, kv_cache, meta, scale, num_splits=splits,
                                     window=window))  # fmt: skip
            launches += 1
    if device.type == "cuda" and num_blocks * page >= LONG_PREFILL_TOKENS:  # the long-prompt tiles
        n = LONG_PREFILL_TOKENS
        meta = AttentionMetadata(
            slot_mapping=torch.full((n,), -1, dtype=torch.long, device=device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
            block_tables=(torch.arange(-(-n // page), dtype=torch.int32, device=device) % num_blocks)[None],
            max_query_len=n,
            max_seq_len=n,
        )  # fmt: skip
        submit(functools.partial(paged_attention_forward, torch.randn(n, num_heads, head_dim, dtype=dtype, device=device),
                                 kv_cache, meta, scale, num_splits=1, window=window))  # fmt: skip
        launches += 1
    return launches


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs


def long_prefill_beside(num_decodes: int, num_seqs: int, num_tokens: int) -> bool:
    """Do decodes share this step with prompts of LONG_PREFILL_TOKENS tokens or more on
    average? Then the decodes take a launch of their own however few they are: the prompts'
    launch then has the 256 x 64 long tiles (in one launch with the decodes it had the short
    ones), and each decode's keys no longer cost a 128-row tile's matrix work (64 x 7,680
    prompts: up to 62 decodes of 8k keys each beside a chunk of the next prompts)."""
    prompts = num_seqs - num_decodes
    return 0 < num_decodes and prompts > 0 and num_tokens - num_decodes >= LONG_PREFILL_TOKENS * prompts


def paged_attention_forward(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    num_splits: int | None = None,
    config: AttnLaunchConfig | None = None,
    out: torch.Tensor | None = None,
    split_decodes: bool | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    window: int | None = None,
) -> torch.Tensor:
    """Attention of q `[T, Hq, D]` over the cache only (the new K/V must already be in it).
    An FP8 cache's keys and values count times `kv_scales` (k's folds into the softmax scale,
    v's into the output). A sliding `window`: the query at p sees keys in (p - window, p] only,
    and each program's key loop starts at the block of its first query's first key.

    A batch that mixes prefill chunks with decodes whose `meta.num_decode_seqs` lead it runs
    as two launches, the decodes with the decode tiles and the rest with the prefill tiles
    (`split_decodes`: None splits from MIN_DECODES_TO_SPLIT decodes on, or beside long prompts
    (`long_prefill_beside`), when neither the tiles nor the split count is forced). In one
    prefill launch, each decode takes a 128-row tile for its GROUP rows, so its keys cost 32x
    the matrix work; and the decodes' rows keep the long prompts from the long-prompt tiles.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, page, num_kv_heads, cache_head_dim = kv_cache.shape
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0
    assert kv_cache.is_contiguous(), "the KV cache must be contiguous"
    assert window is None or window >= 1, window
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    num_seqs = meta.seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    qsl, seq_lens, bt = meta.query_start_loc, meta.seq_lens, meta.block_tables
    nd = meta.num_decode_seqs
    if split_decodes is None:
        split_decodes = (
            config is None
            and num_splits is None
            and (nd >= MIN_DECODES_TO_SPLIT or long_prefill_beside(nd, num_seqs, num_tokens))
        )
    scales = kv_scales if kv_cache.dtype == FP8_KV else (1.0, 1.0)
    if split_decodes and 0 < nd < num_seqs and meta.max_query_len > 1:
        _launch(q, kv_cache, out, qsl, seq_lens, bt, 0, nd, nd, 1, meta.max_seq_len, scale, num_splits, config,
                scales, window=window)  # fmt: skip
        _launch(q, kv_cache, out, qsl, seq_lens, bt, nd, num_seqs - nd, num_tokens - nd, meta.max_query_len,
                meta.max_seq_len, scale, num_splits, config, scales, window=window)  # fmt: skip
        return out
    _launch(q, kv_cache, out, qsl, seq_lens, bt, 0, num_seqs, num_tokens, meta.max_query_len, meta.max_seq_len,
            scale, num_splits, config, scales, window=window)  # fmt: skip
    return out


def _launch(
    q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
    qsl: torch.Tensor, seq_lens: torch.Tensor, bt: torch.Tensor,
    seq0: int, num_seqs: int, num_tokens: int, max_query_len: int, max_seq_len: int, scale: float,
    num_splits: int | None, config: AttnLaunchConfig | None, kv_scales: tuple[float, float] = (1.0, 1.0),
    window: int | None = None,
) -> None:  # fmt: skip
    """One launch over the batch's sequences seq0 .. seq0 + num_seqs - 1 (the whole batch's
    `qsl`, `seq_lens` and block tables are passed, with the offset: slicing them would give
    pointers of other alignments, each a kernel variant compiled on first use); `num_tokens`
    rows of q from qsl[seq0] on (padding past the last sequence included). A `window` compiles
    the kernel's SLIDING variant (one for every window size); None, the full-attention one."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    page, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    on_gpu = q.is_cuda
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))

    num_sms = _num_sms(q.device)
    decode_m = max(16, group_pad)
    decode_q = decode_m // group_pad
    decode_like = max_query_len <= decode_q
    if config is not None:
        cfg = config
    elif not on_gpu:
        cfg = _DECODE_CPU if decode_like else _PREFILL_CPU
    elif decode_like:
        cfg = _DECODE_GPU
    else:
        # long tiles only where nearly every row is a long prompt's: a decode in a 256-row
        # tile computes 64 query slots for its one token (64 x 7,680 prompts with decodes
        # mixed in ran at 808 output tok/s with them on every long step, 861 without)
        long = max_query_len >= LONG_PREFILL_TOKENS and num_tokens // num_seqs >= LONG_PREFILL_TOKENS
        cfg = _PREFILL_GPU_LONG if long and long_tiles_fit(q.dtype, head_dim_pad) else _PREFILL_GPU
    block_m = max(cfg.block_m, group_pad, 16)
    block_q = block_m // group_pad
    one_tile = max_query_len <= block_q
    num_tiles = num_seqs if one_tile else num_tokens // block_q + num_seqs

    if num_splits is None:  # by the keys a tile reads: at most its window's and its own in a window
        keys = max_seq_len if window is None else min(max_seq_len, window + max_query_len)
        num_splits = choose_num_splits(num_tiles, num_kv_heads, keys, num_sms)
    num_splits = max(1, int(num_splits))
    if (
        config is None and on_gpu and decode_like
        and num_tiles * num_kv_heads * num_splits >= _DECODE_LARGE_PROGRAMS_PER_SM * num_sms
    ):  # fmt: skip
        cfg = _DECODE_GPU_LARGE

    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if num_splits > 1:
        part_out = torch.empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
        p_strides = part_out.stride()[:3]
        l_strides = part_lse.stride()[:2]
    else:
        part_out = part_lse = out  # unused
        p_strides = (0, 0, 0)
        l_strides = (0, 0)

    _paged_attn_kernel[(num_tiles, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_out, part_lse,
        qsl, seq_lens, bt,
        seq0, num_seqs, scale * LOG2E * kv_scales[0], kv_scales[1], window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), bt.stride(0),
        *p_strides, *l_strides,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=cfg.block_n, PAGE=page, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        NUM_SPLITS=num_splits, ONE_TILE_PER_SEQ=one_tile,
        DOT_PREC=_dot_precision(q.dtype),
        DOT_F16=kv_cache.dtype == FP8_KV and q.dtype == torch.bfloat16,
        SLIDING=window is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(q.device),
    )  # fmt: skip
    if num_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            part_out, part_lse, out, qsl, seq0, num_seqs,
            *p_strides, *l_strides, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            num_warps=4 if head_dim >= 64 else 1, **launch_options(q.device),
        )  # fmt: skip


def triton_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    num_splits: int | None = None,
    config: AttnLaunchConfig | None = None,
    out: torch.Tensor | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    window: int | None = None,
) -> torch.Tensor:
    """Drop-in for `reference_paged_attention`: write the new K/V, then attend.

    `num_splits` forces the split-KV factor (None: `choose_num_splits`); `config` forces
    the tile shape. Both are keyword-only extras; the positional signature is the
    reference's. Long sequences with no cached context (prompts, or their first chunks:
    `meta.fresh_seqs`, or one such sequence alone) are attended by torch's SDPA over their
    own q/k/v instead (`sdpa_prefill`), long later chunks where it pays (`meta.chunk_seqs`,
    `pad_front_pays`) by SDPA over their whole sequence (`sdpa_after_prefix`), the rest of the
    batch by the kernel. With a sliding `window` (the query at p sees keys in (p - window, p])
    SDPA's causal mask does not serve: fresh prompts of any length from FRESH_KERNEL_TOKENS go to
    `fresh_prefill_attention`, later chunks to the kernel, both reading about `window` keys a query.
    """
    write_kv(k, v, kv_cache, meta.slot_mapping, kv_scales)
    if config is None and num_splits is None:
        # metadata made without the list (outside the engine): one fresh sequence is known from its shapes
        fresh = meta.fresh_seqs or (((0, 0, meta.max_query_len),) if fresh_single_prefill(meta) else ())
        sdpa_from = SDPA_PREFILL_TOKENS if window is None else math.inf
        long = [(seq, first, count, 0) for seq, first, count in fresh if count >= sdpa_from]
        long += [c for c in meta.chunk_seqs if window is None and pad_front_pays(c[3], c[2])]
        own = [(seq, first, count, 0) for seq, first, count in fresh
               if FRESH_KERNEL_TOKENS <= count < sdpa_from] if fresh_kernel_takes(q, k, v) else []  # fmt: skip
        if long or own:
            done = _attend_long_by_sdpa(q, k, v, kv_cache, meta, sorted(long), scale, out, kv_scales, own, window)
            if done is not None:
                return done
    return paged_attention_forward(q, kv_cache, meta, scale, num_splits=num_splits, config=config, out=out,
                                   kv_scales=kv_scales, window=window)  # fmt: skip


def pad_front_pays(cached: int, count: int) -> bool:
    """Is one causal SDPA call over a chunk's whole sequence (its queries padded in front over
    the `cached` tokens, whose rows are computed and dropped) cheaper than the kernel over the
    chunk alone? The padded call does (cached + count)^2 / 2 query-key pairs at SDPA_SPEEDUP
    times the kernel's speed, the kernel count * cached + count^2 / 2; below
    SDPA_CHUNK_MIN_TOKENS in all the call's fixed costs lose."""
    total = cached + count
    return (count >= SDPA_PREFILL_TOKENS and total >= SDPA_CHUNK_MIN_TOKENS
            and total * total < SDPA_SPEEDUP * (2 * cached * count + count * count))  # fmt: skip


def fresh_kernel_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Can `fresh_prefill_attention` read these q/k/v (a head size that is a power of two, rows of
    contiguous heads)?"""
    d = q.shape[-1]
    return d == triton.next_power_of_2(d) and all(t.stride(-1) == 1 for t in (q, k, v))


def _attend_long_by_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                         meta: AttentionMetadata, long: list[tuple[int, int, int, int]], scale: float,
                         out: torch.Tensor | None, kv_scales: tuple[float, float],
                         own: list[tuple[int, int, int, int]] = (), window: int | None = None,
                         ) -> torch.Tensor | None:  # fmt: skip
    """The `long` sequences (sequence, first row, new tokens, cached tokens; in batch order) by
    SDPA, one call each: a fresh one (0 cached) over its own q/k/v (64 x 7,680 prompts run two
    a step: each 0.8 ms a layer in cuDNN against 1.34 in the long tiles), a later chunk over its
    whole sequence from the cache. The `own` ones (fresh prompts, same form) by one launch of
    `fresh_prefill_attention` over their own q/k/v. Then the sequences between them all by the
    kernel, a launch per run of neighbours (the leading decodes apart when prompts follow them).
    A `window` goes to the fresh kernel and the paged one (`long` is then empty). None: SDPA
    unavailable here."""
    scales = kv_scales if kv_cache.dtype == FP8_KV else (1.0, 1.0)
    num_seqs = meta.seq_lens.shape[0]
    if out is None and num_seqs == 1 and long and long[0][2] == q.shape[0]:
        # one sequence, every row: SDPA's own output, not a copy of it (a copy would be a
        # device-to-device memcpy of the whole output: cuDNN's output is laid out as [T, H, D]
        # already, so the model's reshape is a view; another layout would be copied there)
        _, _, _, cached = long[0]
        if cached:
            return sdpa_after_prefix(q, kv_cache, meta.block_tables[0], cached, scale, kv_scales=scales)
        return sdpa_prefill(q, k, v, scale)
    if out is None:
        out = torch.empty_like(q)
    fresh_prefill_attention(q, k, v, tuple((first, count) for _, first, count, _ in own), scale, out, window=window)
    for seq, first, count, cached in long:
        rows = slice(first, first + count)
        if cached:
            done = sdpa_after_prefix(q[rows], kv_cache, meta.block_tables[seq], cached, scale, out[rows], scales)
        else:
            done = sdpa_prefill(q[rows], k[rows], v[rows], scale, out[rows])
        if done is None:
            return None  # (the first call: SDPA is refused per device)
    qsl, seq_lens, bt = meta.query_start_loc, meta.seq_lens, meta.block_tables

    def launch(seq0: int, seqs: int, tokens: int, max_query_len: int) -> None:
        _launch(q, kv_cache, out, qsl, seq_lens, bt, seq0, seqs, tokens, max_query_len, meta.max_seq_len, scale,
                None, None, scales, window=window)  # fmt: skip

    seq, token = 0, 0  # the next sequence (and its first row) the kernel has not covered
    for long_seq, first, count, _ in [*sorted([*long, *own]), (num_seqs, q.shape[0], 0, 0)]:
        if long_seq > seq:  # sequences seq .. long_seq - 1, rows token .. first - 1
            decodes = max(0, min(meta.num_decode_seqs, long_seq) - seq)
            # always apart here, unlike paged_attention_forward's rule (which keeps fewer than 64
            # beside a short chunk): beside fresh long prompts the decodes' contexts are long, and a
            # 128-row tile per decode costs 32x its keys' matrix work (64 x 7,680 ran a little
            # faster this way than with the shared rule: docs/history/benchmarks.md)
            if decodes:
                launch(seq, decodes, decodes, 1)
            if seq + decodes < long_seq:
                launch(seq + decodes, long_seq - seq - decodes, first - token - decodes, meta.max_query_len)
        seq, token = long_seq + 1, first + count
    return out


_SDPA_UNAVAILABLE: set[str] = set()  # devices where SDPA's fast backends refused (then: the Triton kernel)


def fresh_single_prefill(meta: AttentionMetadata) -> bool:
    """One sequence, all of whose tokens are new (no cached prefix), and many of them: known
    on the host from the metadata's shapes and maxima."""
    return (meta.block_tables.shape[0] == 1 and meta.max_seq_len == meta.max_query_len
            and meta.max_query_len >= SDPA_PREFILL_TOKENS)  # fmt: skip


def sdpa_bucket(num_tokens: int) -> int:
    """The length a fresh prefill is padded to for SDPA: cuDNN builds an execution plan per
    shape (tens of ms the first time a length is seen), so lengths share 16 plans an
    octave (at most 1/16 of padding); the warm-up builds them all (`warmup_sdpa_prefill`)."""
    step = max(1, triton.next_power_of_2(num_tokens + 1) // 32)  # the power of two at or below, / 16
    return -(-num_tokens // step) * step


def sdpa_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    pad_to: int | None = None,
) -> torch.Tensor | None:
    """Causal attention of one sequence over its own new keys and values (q `[T, Hq, D]`,
    k/v `[T, Hkv, D]`) with `torch.nn.functional.scaled_dot_product_attention`: cuDNN's or
    flash attention on a GPU, the math backend on a CPU. None when no such backend takes it.

    On a GPU the sequence is padded with zeros to `sdpa_bucket(T)` (`pad_to` forces a length):
    the padding sits after every real token, so causality hides it from the real queries and
    their outputs are exact."""
    n = q.shape[0]
    padded = pad_to if pad_to is not None else (sdpa_bucket(n) if q.is_cuda else n)

    def pad(x: torch.Tensor) -> torch.Tensor:
        if padded == n:
            return x
        buf = x.new_zeros((padded, *x.shape[1:]))
        buf[:n] = x
        return buf

    attn = _sdpa_causal(pad(q), pad(k), pad(v), scale)
    if attn is None:
        return None
    return attn[:n] if out is None else out.copy_(attn[:n])


def sdpa_after_prefix(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cached: int,
    scale: float,
    out: torch.Tensor | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    pad_to: int | None = None,
) -> torch.Tensor | None:
    """Causal attention of a chunk (q `[T, Hq, D]`, its K/V already written) after `cached`
    tokens of its sequence, by one SDPA call over the whole sequence: the keys and values of
    all `cached + T` positions gathered from the cache by the sequence's `block_table` row (an
    FP8 cache's times `kv_scales`), and the chunk's queries placed after `cached` zero rows, so
    the plain causal mask is the chunk's. The padded rows' outputs are dropped. Padded on a GPU
    to `sdpa_bucket(cached + T)` (`pad_to` forces a length) as `sdpa_prefill`. None when SDPA's
    backends refuse."""
    n = q.shape[0]
    total = cached + n
    padded = pad_to if pad_to is not None else (sdpa_bucket(total) if q.is_cuda else total)
    page = kv_cache.shape[2]
    blocks = -(-total // page)
    qp = q.new_zeros((padded, *q.shape[1:]))
    qp[cached:total] = q
    kv = []
    # an FP8 cache is gathered as bytes (index_select need not have FP8 kernels), then read as FP8
    raw = kv_cache.view(torch.uint8) if kv_cache.dtype == FP8_KV else kv_cache
    for i, kv_scale in enumerate(kv_scales):
        # whole pages, then the rows past the sequence zeroed (the last page's tail, the padding)
        buf = torch.empty((max(padded, blocks * page), *kv_cache.shape[3:]), dtype=raw.dtype, device=q.device)
        torch.index_select(raw[i], 0, block_table[:blocks], out=buf[: blocks * page].view(blocks, *kv_cache.shape[2:]))
        buf = buf[:padded].view(kv_cache.dtype)
        if kv_cache.dtype != q.dtype:
            buf = buf.to(q.dtype)
            if kv_scale != 1.0:
                buf.mul_(kv_scale)
        buf[total:] = 0
        kv.append(buf)
    attn = _sdpa_causal(qp, kv[0], kv[1], scale)
    if attn is None:
        return None
    return attn[cached:total] if out is None else out.copy_(attn[cached:total])


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
    """`[T, H, D]` causal SDPA of one sequence (GQA: k/v with fewer heads) by cuDNN, else flash
    (the math backend on a CPU); its `[T, Hq, D]` output (a view), or None if none takes it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = str(q.device)
    if device in _SDPA_UNAVAILABLE:
        return None
    backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION] if q.is_cuda else [SDPBackend.MATH]
    try:
        with sdpa_kernel(backends):
            attn = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, scale=scale, enable_gqa=True,
            )  # fmt: skip
    except RuntimeError:  # no backend for this device, dtype or head size
        _SDPA_UNAVAILABLE.add(device)
        return None
    return attn[0].transpose(0, 1)


def warmup_sdpa_prefill(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        device: torch.device, max_tokens: int) -> int:  # fmt: skip
    """Build SDPA's plan for every padded length a fresh prefill of SDPA_PREFILL_TOKENS to
    `max_tokens` tokens can take (the longest chunk a step holds). Returns how many."""
    lengths = sorted({sdpa_bucket(n) for n in range(SDPA_PREFILL_TOKENS, max_tokens + 1)})
    lengths = [n for n in lengths if n <= sdpa_bucket(max_tokens)]
    for n in lengths:
        q = torch.zeros(n, num_heads, head_dim, dtype=dtype, device=device)
        kv = torch.zeros(n, num_kv_heads, head_dim, dtype=dtype, device=device)
        if sdpa_prefill(q, kv, kv, head_dim**-0.5) is None:
            return 0
    return len(lengths)


__all__ = [
    "AttnLaunchConfig",
    "fresh_single_prefill",
    "sdpa_bucket",
    "sdpa_after_prefix",
    "sdpa_prefill",
    "pad_front_pays",
    "warmup_sdpa_prefill",
    "choose_num_splits",
    "paged_attention_forward",
    "triton_paged_attention",
]
