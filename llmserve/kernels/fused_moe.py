"""Fused mixture of experts in Triton: routing, tokens grouped by expert, two grouped GEMMs, the sum.

PyTorch reference: `llmserve.model.moe.fused_moe_reference` (route_reference, experts_reference).

Five launches, none of which waits on the host (so a CUDA graph captures them for a token count
and replays them for any routing):
1. route: one program a token: the router's softmax over E in float32, the top k (picked on the
   logits, which order as the probabilities do), renormalised over the k when asked.
2. align: one program: the T * k (token, slot) rows sorted by expert, each expert's run padded to
   a multiple of BLOCK_M (pad rows hold the sentinel T * k), and each block's expert; a row of id -1
   (expert parallelism: an expert another rank holds) goes to no block and adds 0. The number
   of blocks is bounded by ceil(T * k / BLOCK_M) + min(E, T * k), which fixes the grid; programs
   past the real count return at once. Experts no token chose get no block and are not read.
3. gate/up: one program per (block, column block of I): the block's tokens times its expert's
   gate and up rows, two float32 accumulators, SiLU(gate) * up written per (token, slot) row.
4. down: one program per (block, column block of H): that times the expert's down rows, scaled
   by the row's routing weight (float32), written per (token, slot) row.
5. reduce: each token's k rows summed in slot order (deterministic: no atomics).

FP8 experts (float8_e4m3fn weights, float32 scales): the tokens are quantized per token before
step 3 and the SiLU-and-mul rows per row before step 4 (kernels/fp8_quant.py, bit-exact with the
reference's `quantize_tokens`); the GEMMs multiply FP8 operands into float32. With a scale per
output channel, both scales multiply the accumulator once, after the K loop; with a scale per
(bn, bk) block (`block_shape`), each K step's product is scaled by its block's scales before it
is added (BLOCK_K divides bk, so a K step lies in one block), the token's scale after the loop.

Tile configs are data (below): `DEFAULT_TILES` is a heuristic keyed by batch bucket (the token
count's bucket: tokens per expert grow with it, and BLOCK_M follows them); `TUNED_TILES` holds
tables measured on this card per shape ("E,H,I", `shape_key`). Both tuned tables are per-card
settings (kernels/tuning.py): `llmserve tune --only moe` measures them and writes the card's
file, `tuning.apply` sets them at engine start; a shape the file does not name takes the defaults.

Small decode steps take a variant of their own (`decode=True`, or chosen by `use_decode`): at one
token a block of BLOCK_M rows holds one real row, and the single-program align step and the
reduce are launches of their own. The variant has no align step: three launches (route,
gate/up, down-and-sum) over the (token, slot) rows as they are, each a GEMV that reads only the
chosen experts' rows:
- gate/up: one program per ((token, slot) row, column block of I);
- down and sum: one program per (token, column block of H), the token's k rows in slot order
  (each rounded to the output dtype before it is added, as the grouped path stores its rows).
A token's k experts are distinct, so at one token no expert is read twice; two tokens may share
one (read twice), so by default only steps of `DECODE_MAX_TOKENS` tokens take it; `TUNED_DECODE`
holds the card's measured limit and tiles per shape (max_tokens 0: the variant never wins there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmserve.kernels.fp8_quant import quantize_tokens_fp8

FP8 = torch.float8_e4m3fn

# batch bucket (the largest token count it covers; the last covers every larger count) -> tiles
DEFAULT_TILES: dict[int, dict[str, int]] = {
    32: dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
    256: dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
    1024: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
    1 << 30: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
}
# this card's measured tables (a per-card setting, kernels/tuning.py): shape_key -> batch bucket -> tiles
TUNED_TILES: dict[str, dict[int, dict[str, int]]] = {}

# the decode variant: steps of at most `max_tokens` tokens take it; BLOCK_N columns of I (gate/up)
# and DOWN_BLOCK_N of H (down) a program, BLOCK_K of the reduced dimension a loop step
DECODE_MAX_TOKENS = 1
DEFAULT_DECODE: dict[str, int] = dict(max_tokens=DECODE_MAX_TOKENS, BLOCK_N=32, BLOCK_K=128, DOWN_BLOCK_N=32,
                                      num_warps=4, num_stages=2)  # fmt: skip
# this card's measured decode settings (a per-card setting): shape_key -> settings as DEFAULT_DECODE's
TUNED_DECODE: dict[str, dict[str, int]] = {}


def shape_key(num_experts: int, hidden: int, intermediate: int) -> str:
    """The tuned tables' key of an experts' shape: "E,H,I" (a JSON object key in the card's file)."""
    return f"{num_experts},{hidden},{intermediate}"


def bucket_tiles(table: dict[int, dict[str, int]], num_tokens: int) -> dict[str, int]:
    """A tile table's entry for `num_tokens`: the smallest bucket that holds the count (the last
    covers larger counts)."""
    buckets = sorted(table)
    return table[next((b for b in buckets if num_tokens <= b), buckets[-1])]


def tile_config(num_tokens: int, num_experts: int, hidden: int, intermediate: int) -> dict[str, int]:
    """The tiles for a step of `num_tokens` tokens: this card's tuned table of this shape, else
    the default one (`bucket_tiles`)."""
    return bucket_tiles(TUNED_TILES.get(shape_key(num_experts, hidden, intermediate)) or DEFAULT_TILES, num_tokens)


def decode_config(num_experts: int, hidden: int, intermediate: int) -> dict[str, int]:
    """The decode variant's settings for this shape: this card's tuned ones, else the default."""
    return TUNED_DECODE.get(shape_key(num_experts, hidden, intermediate), DEFAULT_DECODE)


def use_decode(num_tokens: int, num_experts: int, hidden: int, intermediate: int) -> bool:
    """Whether a step of `num_tokens` tokens takes the decode variant (by default: one token;
    never where the tuned max_tokens is 0)."""
    return 0 < num_tokens <= decode_config(num_experts, hidden, intermediate)["max_tokens"]


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_l, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_TOPK: tl.constexpr, RENORMALIZE: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    es = tl.arange(0, BLOCK_E)
    e_ok = es < E
    logits = tl.load(logits_ptr + t * stride_l + es, mask=e_ok, other=float("-inf")).to(tl.float32)
    top = tl.max(logits, axis=0)
    p = tl.where(e_ok, tl.exp(logits - top), 0.0)
    denom = tl.sum(p, axis=0)
    slots = tl.arange(0, BLOCK_TOPK)
    chosen_p = tl.zeros([BLOCK_TOPK], dtype=tl.float32)
    chosen_e = tl.zeros([BLOCK_TOPK], dtype=tl.int32)
    left = logits
    for j in tl.static_range(TOP_K):
        best = tl.argmax(left, axis=0)
        pick = es == best
        chosen_p = tl.where(slots == j, tl.sum(tl.where(pick, p, 0.0), axis=0), chosen_p)
        chosen_e = tl.where(slots == j, best.to(tl.int32), chosen_e)
        left = tl.where(pick, float("-inf"), left)
    w = chosen_p / denom
    if RENORMALIZE:
        w = w / tl.sum(tl.where(slots < TOP_K, w, 0.0), axis=0)
    tl.store(weights_ptr + t * TOP_K + slots, w, mask=slots < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slots, chosen_e, mask=slots < TOP_K)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, N, E, MAX_BLOCKS,
                  BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, BLOCK_B: tl.constexpr):  # fmt: skip
    es = tl.arange(0, BLOCK_E)
    e_ok = es < E
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, N, CHUNK):  # rows per expert
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < N, other=-1)
        counts += tl.sum((ids[:, None] == es[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    seen = tl.zeros([BLOCK_E], dtype=tl.int32)  # rows of each expert placed so far
    for start in range(0, N, CHUNK):  # each row to its expert's run, in row order
        offs = start + tl.arange(0, CHUNK)
        ok = offs < N
        ids = tl.load(ids_ptr + offs, mask=ok, other=-1)
        onehot = (ids[:, None] == es[None, :]).to(tl.int32)
        before = tl.cumsum(onehot, axis=0) - onehot  # rows of the same expert earlier in the chunk
        pos = tl.sum(onehot * (starts + seen)[None, :] + onehot * before, axis=1)
        tl.store(sorted_ptr + pos, offs, mask=ok & (ids >= 0) & (ids < E))  # id -1: an expert held elsewhere
        seen += tl.sum(onehot, axis=0)
    for b0 in range(0, MAX_BLOCKS, BLOCK_B):  # each block's expert: the experts ending at or before it
        bs = b0 + tl.arange(0, BLOCK_B)
        first = bs * BLOCK_M
        e = tl.sum(((ends[None, :] <= first[:, None]) & e_ok[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + bs, tl.where(e < E, e, -1), mask=bs < MAX_BLOCKS)


# how the weights are scaled (the SCALES constexpr): 16-bit/float32 weights, FP8 with a scale per
# output channel, FP8 with a scale per (SCALE_N, SCALE_K) block
NO_SCALES, CHANNEL_SCALES, BLOCK_SCALES = 0, 1, 2
# the same as the kernels read them: Triton's compiler takes no global but a constexpr (the
# interpreter takes any, so tests/test_kernel_globals.py checks every kernel's globals)
_NO, _CHANNEL, _BLOCK = tl.constexpr(NO_SCALES), tl.constexpr(CHANNEL_SCALES), tl.constexpr(BLOCK_SCALES)


@triton.jit
def _dot(a, w, DOT_PREC: tl.constexpr, SCALES: tl.constexpr):
    if SCALES == _NO:
        return tl.dot(a, w, input_precision=DOT_PREC)
    return tl.dot(a, w, out_dtype=tl.float32)  # FP8 operands, float32 accumulation


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, sx_ptr, sw_ptr, N, H, I,
    stride_xm, stride_we, stride_wn, stride_om, stride_se, stride_sn, stride_sk,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
    SCALES: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):  # past the last block of this step
        return
    e = tl.load(block_expert_ptr + pid_m)
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # N: padding
    row_ok = rows < N
    tok = rows // TOP_K
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < I
    w_base = w_ptr + e.to(tl.int64) * stride_we
    s_base = sw_ptr + e.to(tl.int64) * stride_se
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, H, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        a = tl.load(x_ptr + tok[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        w_gate = tl.load(w_base + ns[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(w_base + (ns + I)[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
        if SCALES == _BLOCK:  # this K step's blocks of the gate and up rows
            s_k = s_base + (k // SCALE_K) * stride_sk
            s_gate = tl.load(s_k + (ns // SCALE_N) * stride_sn, mask=n_ok, other=0.0)
            s_up = tl.load(s_k + ((ns + I) // SCALE_N) * stride_sn, mask=n_ok, other=0.0)
            acc_gate += _dot(a, w_gate, DOT_PREC, SCALES) * s_gate[None, :]
            acc_up += _dot(a, w_up, DOT_PREC, SCALES) * s_up[None, :]
        else:
            acc_gate += _dot(a, w_gate, DOT_PREC, SCALES)
            acc_up += _dot(a, w_up, DOT_PREC, SCALES)
    if SCALES == _CHANNEL:
        acc_gate *= tl.load(s_base + ns * stride_sn, mask=n_ok, other=0.0)[None, :]
        acc_up *= tl.load(s_base + (ns + I) * stride_sn, mask=n_ok, other=0.0)[None, :]
    if SCALES != _NO:  # the token's scale
        sx = tl.load(sx_ptr + tok, mask=row_ok, other=0.0)[:, None]
        acc_gate *= sx
        acc_up *= sx
    h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up  # SiLU(gate) * up
    tl.store(out_ptr + rows[:, None] * stride_om + ns[None, :], h.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])  # fmt: skip


@triton.jit
def _down_kernel(
    a_ptr, w_ptr, weights_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, sa_ptr, sw_ptr, N, H, I,
    stride_am, stride_we, stride_wn, stride_om, stride_se, stride_sn, stride_sk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
    SCALES: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):  # past the last block of this step
        return
    e = tl.load(block_expert_ptr + pid_m)
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # N: padding
    row_ok = rows < N
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < H
    w_base = w_ptr + e.to(tl.int64) * stride_we
    s_base = sw_ptr + e.to(tl.int64) * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, I, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        k_ok = ks < I
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + ns[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if SCALES == _BLOCK:
            s_w = tl.load(s_base + (k // SCALE_K) * stride_sk + (ns // SCALE_N) * stride_sn, mask=n_ok, other=0.0)
            acc += _dot(a, w, DOT_PREC, SCALES) * s_w[None, :]
        else:
            acc += _dot(a, w, DOT_PREC, SCALES)
    if SCALES == _CHANNEL:
        acc *= tl.load(s_base + ns * stride_sn, mask=n_ok, other=0.0)[None, :]
    if SCALES != _NO:  # the row's scale
        acc *= tl.load(sa_ptr + rows, mask=row_ok, other=0.0)[:, None]
    acc = acc * tl.load(weights_ptr + rows, mask=row_ok, other=0.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_om + ns[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])  # fmt: skip


@triton.jit
def _gemv_step(a, w_ptrs, w_mask, s_ptrs, n_ok, SCALES: tl.constexpr):
    """One K step of a GEMV: w [BLOCK_N, BLOCK_K] (rows of the weight) times a [BLOCK_K], in
    float32; with block scales, the step's product scaled by its block's scale per column."""
    w = tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32)
    part = tl.sum(w * a[None, :], axis=1)
    if SCALES == _BLOCK:
        part *= tl.load(s_ptrs, mask=n_ok, other=0.0)
    return part


@triton.jit
def _gate_up_decode_kernel(
    x_ptr, w_ptr, out_ptr, ids_ptr, sx_ptr, sw_ptr, H, I,
    stride_xm, stride_we, stride_wn, stride_om, stride_se, stride_sn, stride_sk,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALES: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)  # the (token, slot) row
    e = tl.load(ids_ptr + r)
    if e < 0:  # an expert another rank holds: the down kernel reads nothing of this row
        return
    tok = r // TOP_K
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < I
    w_base = w_ptr + e.to(tl.int64) * stride_we
    s_base = sw_ptr + e.to(tl.int64) * stride_se
    acc_gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in range(0, H, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        a = tl.load(x_ptr + tok * stride_xm + ks, mask=k_ok, other=0.0).to(tl.float32)
        w_mask = n_ok[:, None] & k_ok[None, :]
        s_k = s_base + (k // SCALE_K) * stride_sk
        acc_gate += _gemv_step(a, w_base + ns[:, None] * stride_wn + ks[None, :], w_mask,
                               s_k + (ns // SCALE_N) * stride_sn, n_ok, SCALES)  # fmt: skip
        acc_up += _gemv_step(a, w_base + (ns + I)[:, None] * stride_wn + ks[None, :], w_mask,
                             s_k + ((ns + I) // SCALE_N) * stride_sn, n_ok, SCALES)  # fmt: skip
    if SCALES == _CHANNEL:
        acc_gate *= tl.load(s_base + ns * stride_sn, mask=n_ok, other=0.0)
        acc_up *= tl.load(s_base + (ns + I) * stride_sn, mask=n_ok, other=0.0)
    if SCALES != _NO:  # the token's scale
        sx = tl.load(sx_ptr + tok)
        acc_gate *= sx
        acc_up *= sx
    h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up  # SiLU(gate) * up
    tl.store(out_ptr + r * stride_om + ns, h.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _down_decode_kernel(
    a_ptr, w_ptr, weights_ptr, ids_ptr, out_ptr, sa_ptr, sw_ptr, H, I,
    stride_am, stride_we, stride_wn, stride_o, stride_se, stride_sn, stride_sk,
    TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALES: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < H
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # the token's rows in slot order, as the grouped path sums them
        r = t * TOP_K + j
        e = tl.load(ids_ptr + r)
        # an expert another rank holds (-1): its row adds 0 and nothing of it is read (all masked)
        width = tl.where(e >= 0, I, 0)
        e_safe = tl.maximum(e, 0).to(tl.int64)
        w_base = w_ptr + e_safe * stride_we
        s_base = sw_ptr + e_safe * stride_se
        row_ok = ns < tl.where(e >= 0, H, 0)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k in range(0, I, BLOCK_K):
            ks = k + tl.arange(0, BLOCK_K)
            k_ok = ks < width
            a = tl.load(a_ptr + r * stride_am + ks, mask=k_ok, other=0.0).to(tl.float32)
            acc += _gemv_step(a, w_base + ns[:, None] * stride_wn + ks[None, :], row_ok[:, None] & k_ok[None, :],
                              s_base + (k // SCALE_K) * stride_sk + (ns // SCALE_N) * stride_sn, row_ok, SCALES)  # fmt: skip
        if SCALES == _CHANNEL:
            acc *= tl.load(s_base + ns * stride_sn, mask=row_ok, other=0.0)
        if SCALES != _NO:  # the row's scale (a row of every rank's: always there)
            acc *= tl.load(sa_ptr + r)
        acc = acc * tl.load(weights_ptr + r)
        total += acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # the row as the grouped path stores it
    tl.store(out_ptr + t * stride_o + ns, total.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _reduce_kernel(rows_ptr, out_ptr, H, stride_r, stride_o, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(rows_ptr + (t * TOP_K + j) * stride_r + hs, mask=h_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + hs, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, top_k] float32, expert ids [T, top_k] int32), best first."""
    num_tokens, num_experts = router_logits.shape
    assert 1 <= top_k <= num_experts and router_logits.stride(-1) == 1, (router_logits.shape, top_k)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](
            router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
            BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_TOPK=triton.next_power_of_2(top_k),
            RENORMALIZE=renormalize,
        )  # fmt: skip
    return weights, ids


def max_blocks(rows: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the blocks `rows` (token, slot) rows fill when each expert's run is padded
    to `block_m`: every block full but one per expert that has rows."""
    return triton.cdiv(rows, block_m) + min(num_experts, rows)


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted rows [max_blocks * block_m]: (token, slot) rows t * k + j grouped by
    expert in expert order, each run padded with T * k to a multiple of block_m; each block's
    expert [max_blocks] (-1 past the last); the padded row count [1])."""
    n = ids.numel()
    blocks = max_blocks(n, num_experts, block_m)
    sorted_rows = torch.full((blocks * block_m,), n, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    num_padded = torch.zeros(1, dtype=torch.int32, device=ids.device)
    if n:
        _align_kernel[(1,)](
            ids.reshape(-1), sorted_rows, block_expert, num_padded, n, num_experts, blocks, BLOCK_M=block_m,
            BLOCK_E=triton.next_power_of_2(num_experts), CHUNK=64, BLOCK_B=64,
        )  # fmt: skip
    return sorted_rows, block_expert, num_padded


@dataclass(frozen=True, slots=True)
class ExpertScales:
    """FP8 experts' float32 scales: per output channel (`w13 [E, 2I, 1]`, `w2 [E, H, 1]`), or per
    `block_shape` (bn, bk) block (`[E, ceil(N / bn), ceil(K / bk)]`)."""

    w13: torch.Tensor
    w2: torch.Tensor
    block_shape: tuple[int, int] | None = None

    @property
    def mode(self) -> int:
        return CHANNEL_SCALES if self.block_shape is None else BLOCK_SCALES

    def check(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        e, two_i, h = w13.shape
        if self.block_shape is None:
            want13, want2 = (e, two_i, 1), (e, h, 1)
        else:
            bn, bk = self.block_shape
            assert (two_i // 2) % bn == 0, f"the experts' width {two_i // 2} is not a multiple of the scale block {bn}"
            want13, want2 = (e, two_i // bn, triton.cdiv(h, bk)), (e, triton.cdiv(h, bn), triton.cdiv(w2.shape[2], bk))
        assert tuple(self.w13.shape) == want13 and tuple(self.w2.shape) == want2, (self.w13.shape, self.w2.shape)
        assert self.w13.dtype == self.w2.dtype == torch.float32


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    """A scale tensor's strides (the weight's own where there are no scales: never read)."""
    return t.stride(0), t.stride(1), t.stride(2)


def _scale_k_tile(block_k: int, scales: ExpertScales | None) -> int:
    """BLOCK_K, so that a K step lies inside one scale block: a divisor of bk."""
    if scales is None or scales.block_shape is None:
        return block_k
    bk = scales.block_shape[1]
    while bk % block_k:
        block_k //= 2
    assert block_k >= 16, f"scale blocks {scales.block_shape}: K steps of {block_k} (tl.dot takes at least 16)"
    return block_k


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  tiles: dict[str, int] | None = None, partial: bool = False,
                  scales: ExpertScales | None = None, decode: bool | None = None) -> torch.Tensor:  # fmt: skip
    """x [T, H] through its experts `ids [T, k]` (w13 [E, 2I, H], w2 [E, H, I]), summed with
    `weights [T, k]`: [T, H] in x's dtype. `partial`: some ids are -1 (experts held by another
    rank), whose rows add nothing. `scales`: the weights are FP8 (E4M3) with these scales; the
    tokens and the SiLU-and-mul rows are quantized per row. `decode`: the decode variant (True),
    the grouped kernels (False), or as `use_decode` says for this step (None; given `tiles`, the
    grouped kernels)."""
    num_tokens, hidden = x.shape
    num_experts, two_i, hidden_w = w13.shape
    inter = two_i // 2
    top_k = ids.shape[1]
    assert hidden_w == hidden and w2.shape == (num_experts, hidden, inter), (x.shape, w13.shape, w2.shape)
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1, (w13.stride(), w2.stride())
    if scales is None:
        assert x.dtype == w13.dtype == w2.dtype, (w13.dtype, x.dtype)
    else:
        assert w13.dtype == w2.dtype == FP8, (w13.dtype, w2.dtype)
        scales.check(w13, w2)
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    if decode is None:
        decode = tiles is None and use_decode(num_tokens, num_experts, hidden, inter)
    if decode:
        return _decode_experts(x, w13, w2, weights, ids, scales, out, decode_config(num_experts, hidden, inter))
    t = tiles or tile_config(num_tokens, num_experts, hidden, inter)
    bm, bn, bk = t["BLOCK_M"], t["BLOCK_N"], _scale_k_tile(t["BLOCK_K"], scales)
    launch = dict(num_warps=t["num_warps"], num_stages=t["num_stages"])
    sorted_rows, block_expert, num_padded = align(ids, num_experts, bm)
    n = num_tokens * top_k
    blocks = block_expert.shape[0]
    prec = _dot_precision(x.dtype)
    mode = NO_SCALES if scales is None else scales.mode
    scale_n, scale_k = scales.block_shape if scales is not None and scales.block_shape else (1, 1)
    a_in, sx = (x, x) if scales is None else quantize_tokens_fp8(x)  # sx unread without scales
    s13 = w13 if scales is None else scales.w13
    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blocks, triton.cdiv(inter, bn))](
        a_in, w13, act, sorted_rows, block_expert, num_padded, sx, s13, n, hidden, inter,
        a_in.stride(0), w13.stride(0), w13.stride(1), act.stride(0), *_strides(s13),
        TOP_K=top_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC=prec, SCALES=mode, SCALE_N=scale_n,
        SCALE_K=scale_k, **launch,
    )  # fmt: skip
    # rows of an expert held elsewhere (id -1) are in no block and never written: they must add 0
    rows = (torch.zeros if partial else torch.empty)(n, hidden, dtype=x.dtype, device=x.device)
    weights = weights.to(torch.float32).contiguous()
    a_down, sa = (act, act) if scales is None else quantize_tokens_fp8(act)
    s2 = w2 if scales is None else scales.w2
    _down_kernel[(blocks, triton.cdiv(hidden, bn))](
        a_down, w2, weights, rows, sorted_rows, block_expert, num_padded, sa, s2, n, hidden, inter,
        a_down.stride(0), w2.stride(0), w2.stride(1), rows.stride(0), *_strides(s2),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC=prec, SCALES=mode, SCALE_N=scale_n, SCALE_K=scale_k, **launch,
    )  # fmt: skip
    block_h = min(1024, triton.next_power_of_2(hidden))
    _reduce_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        rows, out, hidden, rows.stride(0), out.stride(0), TOP_K=top_k, BLOCK_H=block_h
    )
    return out


def _decode_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    scales: ExpertScales | None, out: torch.Tensor, cfg: dict[str, int]) -> torch.Tensor:  # fmt: skip
    """`fused_experts`' decode variant (checked inputs; `out` [T, H] to fill): two GEMV launches
    over the (token, slot) rows, no align step, the sum in the down kernel."""
    num_tokens, hidden = x.shape
    inter = w2.shape[2]
    top_k = ids.shape[1]
    n = num_tokens * top_k
    bn, bk, down_bn = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["DOWN_BLOCK_N"]
    if scales is not None and scales.block_shape is not None:  # a K step inside one scale block
        bk = math.gcd(bk, scales.block_shape[1])
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    mode = NO_SCALES if scales is None else scales.mode
    scale_n, scale_k = scales.block_shape if scales is not None and scales.block_shape else (1, 1)
    flat_ids = ids.reshape(-1).to(torch.int32).contiguous()
    a_in, sx = (x, x) if scales is None else quantize_tokens_fp8(x)  # sx unread without scales
    s13 = w13 if scales is None else scales.w13
    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    _gate_up_decode_kernel[(n, triton.cdiv(inter, bn))](
        a_in, w13, act, flat_ids, sx, s13, hidden, inter,
        a_in.stride(0), w13.stride(0), w13.stride(1), act.stride(0), *_strides(s13),
        TOP_K=top_k, BLOCK_N=bn, BLOCK_K=bk, SCALES=mode, SCALE_N=scale_n, SCALE_K=scale_k, **launch,
    )  # fmt: skip
    weights = weights.to(torch.float32).contiguous()
    a_down, sa = (act, act) if scales is None else quantize_tokens_fp8(act)
    s2 = w2 if scales is None else scales.w2
    _down_decode_kernel[(num_tokens, triton.cdiv(hidden, down_bn))](
        a_down, w2, weights, flat_ids, out, sa, s2, hidden, inter,
        a_down.stride(0), w2.stride(0), w2.stride(1), out.stride(0), *_strides(s2),
        TOP_K=top_k, BLOCK_N=down_bn, BLOCK_K=bk, SCALES=mode, SCALE_N=scale_n, SCALE_K=scale_k, **launch,
    )  # fmt: skip
    return out


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
              renormalize: bool, first_expert: int = 0, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, block_shape: tuple[int, int] | None = None,
              tiles: dict[str, int] | None = None, decode: bool | None = None) -> torch.Tensor:  # fmt: skip
    """The routed experts' output [T, H]: `route` then `fused_experts` (`LayerOps.fused_moe`). With
    `w13`/`w2` holding experts [first_expert, first_expert + len(w13)) of the router's (expert
    parallelism), the rows routed elsewhere get id -1 (`align` places them in no block) and add 0.
    FP8 experts: `w13_scale`/`w2_scale` per output channel, or per `block_shape` block. `decode`:
    as `fused_experts` takes it."""
    scales = None if w13_scale is None else ExpertScales(w13_scale, w2_scale, block_shape)
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    weights, ids = route(router_logits, top_k, renormalize)
    if w13.shape[0] != router_logits.shape[-1]:
        ids = torch.where((ids >= first_expert) & (ids < first_expert + w13.shape[0]), ids - first_expert, -1)
        return fused_experts(x, w13, w2, weights, ids, tiles, partial=True, scales=scales, decode=decode)
    return fused_experts(x, w13, w2, weights, ids, tiles, scales=scales, decode=decode)
