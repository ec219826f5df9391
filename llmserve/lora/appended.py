"""Every slot's A appended under a base projection's weight, so that one GEMM gives a step of one
token both the base output and every slot's shrink (issue 22, batch 1).

At batch 1 a projection's adapter is two kernels of a few µs each (shrink, expand), each bound by
its launch, not its bytes. With the rows of A (slots x slices x max_rank of them) stored right
after the base weight's rows in one matrix, `F.linear(x, W_ext)` returns [y | x @ A_s^T for every
slot s]: the shrink rides in the base GEMM for the cost of its extra rows' bytes, and one expand
kernel (`lora_expand_appended`) picks each token's slot and adds its delta into y. The base layer
keeps working unchanged on its own rows: its weight becomes a view of the first rows.

It pays only where the extra rows are few next to the base's (H200, 8 slots of rank 16, one
token: o_proj 12.8 µs against 16.1 overlapped, gate_up 61.4 against 64.7, down 37.4 against
38.7; qkv, with 384 extra rows on 6,144, 21.9 against 20.7 overlapped: docs/benchmarks.md), hence
`APPEND_MAX_FRACTION`. The A rows here are a copy of the slot store's (which the shrink of larger
steps reads), rewritten whenever a slot is written (SlotWeights.on_slot_written).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmserve.model.tensor_parallel import RowParallelLinear

# append only where the extra rows are at most this share of the base's (their bytes' cost in the
# GEMM against the two launches they save)
APPEND_MAX_FRACTION = 1 / 32


@dataclass(frozen=True, slots=True)
class AppendedWeight:
    weight: torch.Tensor  # [out + slots * slices * max_rank, in]: the base's rows, then every slot's A
    bias: torch.Tensor | None  # [out + extra]: the base's bias, then zeros
    out_features: int
    a: torch.Tensor  # [slots, slices, max_rank, in]: the appended rows, as the slot store lays A out

    def t_all(self, full: torch.Tensor) -> torch.Tensor:
        """The shrink part of `F.linear(x, weight, bias)`'s output: [T, slots, slices, max_rank]."""
        return full[:, self.out_features :].unflatten(1, self.a.shape[:3])


def can_append(base: nn.Module, a: torch.Tensor) -> bool:
    """A plain linear layer of the activations' dtype (not FP8; a row-parallel one on one rank
    only, where it is `F.linear`), whose extra rows would be at most APPEND_MAX_FRACTION of its own."""
    plain = type(base) is nn.Linear or (type(base) is RowParallelLinear and base.tp.world_size == 1)
    if not plain or base.weight.dtype != a.dtype:
        return False
    extra = a.shape[0] * a.shape[1] * a.shape[2]
    return extra <= base.weight.shape[0] * APPEND_MAX_FRACTION


def append_a(base: nn.Module, a: torch.Tensor) -> AppendedWeight:
    """Move `base`'s weight (and bias) into a matrix with `a` [slots, slices, max_rank, in]
    appended; `base` then reads views of its first rows. One projection at a time: the transient
    memory is that one weight."""
    out, in_features = base.weight.shape
    extra = a.shape[0] * a.shape[1] * a.shape[2]
    weight = torch.empty(out + extra, in_features, dtype=base.weight.dtype, device=base.weight.device)
    weight[:out].copy_(base.weight.data)
    weight[out:].copy_(a.reshape(extra, in_features))
    base.weight.data = weight[:out]
    bias = None
    if base.bias is not None:
        bias = torch.zeros(out + extra, dtype=base.bias.dtype, device=base.bias.device)
        bias[:out].copy_(base.bias.data)
        base.bias.data = bias[:out]
    return AppendedWeight(weight, bias, out, weight[out:].view(a.shape))
