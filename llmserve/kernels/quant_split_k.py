"""Split-K for the quantized decode GEMMs (INT8 W8A8, W4A16, GGUF kept quantized): the rule that
picks the slice count, stored as data, and the in-launch sum of the slices' partials.

With few tokens a GEMM over a 4096 x 4096 weight in 64-wide N tiles is 64 programs: too few to
stream the weight on 132 SMs. Split along K too, and `tiles x split_k` programs read it, each
its slice of the inputs. As in the FP8 split-K GEMM (llmserve/kernels/split_k_gemm.py) the
partials are added inside the same launch: each program stores its partial, counts itself in a
per-tile counter, and the program that arrives last adds the tile's partials in slice order (the
same result on every run, unlike atomic adds of the values), applies the kernel's epilogue and
zeroes the counter for the next call. The counters live in a small per-device workspace that is
all zeros between calls (CUDA graphs replay the same addresses); it is this module's own, apart
from the FP8 kernel's.

The rule: a kernel module holds a `SplitKRule` (`SPLIT_K_RULE`); up to `max_rows` tokens the K steps
are split so that about `programs` programs run (never more slices than K steps); more tokens,
or off a GPU (the interpreter), one slice: the kernel as it was. A caller may name the count. The values in the code are heuristic defaults (the FP8
kernel's measured 256 programs at decode); `llmserve tune` can hold a card's own (the modules
are in `llmserve.kernels.tuning.TUNABLE`, a rule as an object of its two fields).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_TILES = 1 << 16  # counters in the workspace: output tiles of the widest projection
_workspaces: dict[torch.device, torch.Tensor] = {}  # per-device scratch, not state: zero between calls


@dataclass(frozen=True)
class SplitKRule:
    """Up to `max_rows` tokens (0: never) split K so that about `programs` programs run."""

    max_rows: int
    programs: int


def split_k_count(rule: SplitKRule, m: int, k_steps: int, tiles: int, gpu: bool = True) -> int:
    """Slices of K for `m` tokens, `k_steps` K steps (blocks the kernel reads a step), `tiles`
    output tiles: 1 past `rule.max_rows` or off a GPU (the interpreter has no SMs to fill: the
    tests ask for slices by count), else about `rule.programs // tiles`, at most `k_steps`."""
    if not gpu or m > rule.max_rows or tiles <= 0:
        return 1
    return max(1, min(k_steps, rule.programs // tiles))


def slice_steps(k_steps: int, split_k: int) -> tuple[int, int]:
    """(K steps a slice, slices) for `split_k` asked: every slice but the last has the same number
    of steps and none is empty (so the slice count may come out lower than asked)."""
    if k_steps <= 0:
        return 0, 1
    per = triton.cdiv(k_steps, max(1, min(split_k, k_steps)))
    return per, triton.cdiv(k_steps, per)


def counters(device: torch.device) -> torch.Tensor:
    """The per-tile arrival counters of `device` (all zero between calls)."""
    if device not in _workspaces:
        _workspaces[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return _workspaces[device]


def partials(split_k: int, m: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Scratch for the slices' partial sums, [split_k, m, n] (a placeholder for one slice)."""
    return torch.empty((split_k, m, n) if split_k > 1 else (1,), dtype=dtype, device=device)


@dataclass(frozen=True)
class SplitPlan:
    """One launch's slicing: K steps a slice, slices, the partials' scratch and the arrival
    counters (for one slice the scratch placeholder again, never read)."""

    steps: int
    split_k: int
    part: torch.Tensor
    count: torch.Tensor


def plan_split(rule: SplitKRule, asked: int | None, m: int, n: int, k_steps: int, tiles: int,
               acc_dtype: torch.dtype, device: torch.device) -> SplitPlan:  # fmt: skip
    """The slicing of an `m` x `n` GEMM of `k_steps` K steps over `tiles` output tiles: `asked`
    slices (None: as `rule` says on this device), evened out by `slice_steps`; partials in
    `acc_dtype`."""
    if asked is None:
        asked = split_k_count(rule, m, k_steps, tiles, device.type == "cuda")
    steps, split_k = slice_steps(k_steps, asked)
    assert split_k == 1 or tiles <= MAX_TILES, (m, n)
    part = partials(split_k, m, n, acc_dtype, device)
    return SplitPlan(steps, split_k, part, counters(device) if split_k > 1 else part)


@triton.jit
def sum_slices(acc, part_ptr, count_ptr, tile_id, pid_k, offs, mask, split_stride, SPLIT_K: tl.constexpr):
    """Store this slice's partial `acc` at `part_ptr + pid_k * split_stride + offs` (where `mask`);
    return (the tile's partials added in slice order, `mask`) to the tile's last slice to arrive,
    (zeros, all False) to the others: the caller's epilogue stores under the returned mask."""
    tl.store(part_ptr + pid_k * split_stride + offs, acc, mask=mask)
    tl.debug_barrier()  # every thread's store issued before the count (released by the atomic)
    arrived = tl.atomic_add(count_ptr + tile_id, 1, sem="acq_rel")
    total = tl.zeros_like(acc)
    if arrived == SPLIT_K - 1:  # the last slice of this tile: add all of them in order
        for s in range(SPLIT_K):
            total += tl.load(part_ptr + s * split_stride + offs, mask=mask, other=0, cache_modifier=".cg")
        tl.atomic_xchg(count_ptr + tile_id, 0)  # zero again for the next call
    # (the arrival compared as a tile, not a scalar: the interpreter widens a scalar int1 ANDed in)
    return total, mask & ((offs * 0 + arrived) == SPLIT_K - 1)


__all__ = ["MAX_TILES", "SplitKRule", "counters", "partials", "slice_steps", "split_k_count", "sum_slices"]
