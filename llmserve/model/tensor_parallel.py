"""Tensor parallelism inside the model: the rank's group and the sharded layers.

Megatron-style: q/k/v and gate/up are column-parallel (each rank owns a slice of the heads
and of the intermediate size, no communication), o_proj and down_proj are row-parallel
(each rank multiplies its slice, then one all-reduce sums the partial outputs), the
embedding and the LM head are split over the vocabulary (masked lookup + all-reduce;
local logits + all-gather). With one rank every layer is exactly the plain PyTorch layer.

The collectives use torch.distributed's default process group (one tensor-parallel engine
per process; `llmserve.engine.tp_workers` sets it up and tears it down).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llmserve.model.arch import ModelArch
from llmserve.model.interface import local_arch  # noqa: F401  (re-exported: the layers import it here)


@dataclass
class TPGroup:
    """This rank's place in the tensor-parallel group. The collectives run on the default
    torch.distributed group (NCCL on GPUs, gloo on CPUs); `cpu_group` (gloo) carries host
    values. Nothing is communicated when there is one rank."""

    rank: int = 0
    world_size: int = 1
    cpu_group: object | None = None
    # mixtures of experts: whole experts per rank (`--enable-expert-parallel`), not every expert's slice
    expert_parallel: bool = False
    # the device collectives' group: None, the default group; under pipeline parallelism this
    # stage's tensor-parallel ranks (engine/pp_stages.py)
    group: object | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (every rank must call it)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


SINGLE = TPGroup()


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r of a tensor-parallel group uses GPU r."""
    return torch.device(f"cuda:{rank}") if device == "cuda" else torch.device(device)


def check_tp_shape(arch: ModelArch, world_size: int, expert_parallel: bool = False) -> str | None:
    """Why this model cannot be split over `world_size` ranks, or None."""
    if world_size < 1:
        return f"tensor_parallel_size must be >= 1, got {world_size}"
    for name, value in arch.tp_split_sizes(expert_parallel).items():
        if value % world_size:
            how = " with --enable-expert-parallel" if expert_parallel else ""
            return f"{name} ({value}) is not divisible by tensor_parallel_size {world_size}{how}"
    return None


class RowParallelLinear(nn.Module):
    """y = x_rank @ W_rank^T summed over ranks (+ bias once). Weight: [out, in / world]."""

    def __init__(self, in_local: int, out_features: int, bias: bool, tp: TPGroup, linear=F.linear) -> None:
        """`linear`: the product (`F.linear`, or the model's fast path for few rows)."""
        super().__init__()
        self.tp = tp
        self.linear = linear
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(self.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * per_rank, (rank + 1) * per_rank) of the vocabulary (padded up)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.world_size)
        self.start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the rows it gives (model/int8_embedding.py: int8 rows come out in the model's)."""
        return self.weight.dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor | None = None, linear=F.linear) -> torch.Tensor:
        """hidden @ W^T over the whole vocabulary (`weight`: an untied LM head's shard), by `linear`
        (`F.linear`, or the model's fast path for few rows)."""
        local = linear(hidden, self.weight if weight is None else weight)
        return self.tp.all_gather_last_dim(local)[..., : self.vocab_size]


def rank_slice(tensor: torch.Tensor, dim: int, per_rank: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s part of a whole checkpoint tensor split along `dim` into parts of
    `per_rank` (the last part may be shorter: a padded vocabulary)."""
    start = rank * per_rank
    return tensor.narrow(dim, start, max(0, min(per_rank, tensor.shape[dim] - start)))
