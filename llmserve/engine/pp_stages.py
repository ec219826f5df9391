"""Pipeline parallelism across processes: where each rank sits, and the hand-over between stages.

The engine's ranks form a grid of `pipeline_parallel_size` stages x `tensor_parallel_size` ranks.
Global rank 0 (the engine core's own ModelRunner, the driver) is tensor rank 0 of the *last*
stage: it schedules, builds each step's flat batch, mirrors it to every worker (as under tensor
parallelism), runs the last layers and the LM head, and samples with its own request state, so
the sampled tokens never travel. Every other stage runs the step as the batch arrives: the first
from the token ids, later ones from the (hidden states, residual) the stage before sends
(point-to-point `send`/`recv` on the default group: NCCL on GPUs, gloo on CPUs), each tensor
rank to the same tensor rank of the next stage. A stage's tensor-parallel collectives run in a
group of its own ranks.

    rank:   0 .. T-1 = last stage, T .. 2T-1 = the stage before, ..., (P-1)T .. PT-1 = first stage

With several batches in flight (engine/pp_batches.py) each hand-over is tagged with its batch's
sequence number (`StageLink.tag`), and a stage's send does not wait for the next stage to take it
before the stage goes on to its next batch (at most one send outstanding a link, in order).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llmserve.engine.pp_batches import StageClock
from llmserve.model.interface import HiddenCapture
from llmserve.model.pipeline import WHOLE, PipelineStage, pipeline_stage
from llmserve.model.tensor_parallel import TPGroup


@dataclass(frozen=True, slots=True)
class RankPlace:
    """A global rank's place in the stages x tensor ranks grid."""

    rank: int
    tp_size: int = 1
    pp_size: int = 1

    @property
    def stage(self) -> int:
        return self.pp_size - 1 - self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    def rank_of(self, stage: int, tp_rank: int | None = None) -> int:
        """The global rank of `tp_rank` (default: this rank's) in `stage`."""
        return (self.pp_size - 1 - stage) * self.tp_size + (self.tp_rank if tp_rank is None else tp_rank)


SETUP_TAG = 0x7FFFFFFF  # the tag of hand-overs at start (batches count up from 1, below 0x40000000)


class StageLink:
    """This rank's neighbours in the pipeline: it receives the carried tensors from the same
    tensor rank of the stage before, and sends its own to the stage after."""

    def __init__(self, place: RankPlace, stage: PipelineStage, hidden_size: int, world_cpu_group: object) -> None:
        self.place = place
        self.stage = stage
        self.hidden_size = hidden_size
        self.prev = None if stage.is_first else place.rank_of(place.stage - 1)
        self.next = None if stage.is_last else place.rank_of(place.stage + 1)
        self.world_cpu_group = world_cpu_group
        self.sent_bytes = 0  # carried bytes sent so far (the scaling model's communication term)
        self.tag = 0  # the tag of the batch being run (its sequence number, StepInputs.seq)
        self.clock = StageClock()  # time in this stage's layers (the bubble's measure)
        self.wait_s = 0.0  # time spent waiting on the links, within the current forward
        self._sending: tuple[object, torch.Tensor] | None = None  # the send still on its way, and its tensor

    def send(self, hidden: torch.Tensor, residual: torch.Tensor, *states: torch.Tensor) -> None:
        """The carried tensors, as one [2, T, H] tensor (one message a step; [2 + n, T, H] with the
        n states an EAGLE head reads from this stage and those before), tagged with the batch's
        number; returns once the previous send is taken, not this one."""
        both = torch.stack((hidden, residual, *states)).contiguous()
        self.flush()
        self._sending = (dist.isend(both, self.next, tag=self.tag), both)
        self.sent_bytes += both.numel() * both.element_size()

    def flush(self) -> None:
        """Wait until the send on its way (if any) is taken by the next stage."""
        if self._sending is not None:
            began = time.perf_counter()
            self._sending[0].wait()
            self._sending = None
            self.wait_s += time.perf_counter() - began

    def recv(self, num_tokens: int, dtype: torch.dtype, device: torch.device, states: int = 0) -> torch.Tensor:
        """What the stage before sent: [2 + states, T, H] (hidden, residual, then the states)."""
        both = torch.empty((2 + states, num_tokens, self.hidden_size), dtype=dtype, device=device)
        began = time.perf_counter()
        dist.recv(both, self.prev, tag=self.tag)
        self.wait_s += time.perf_counter() - began
        return both

    def first_to_driver(self, tensor: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor | None:  # fmt: skip
        """At start (no batch in flight), a tensor of the first stage's tensor rank 0 handed to the
        driver (global rank 0): the driver gets it, every other rank None."""
        src = self.place.rank_of(0, 0)
        if self.place.rank == src:
            dist.send(tensor.contiguous(), 0, tag=SETUP_TAG)
        elif self.place.rank == 0:
            out = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(out, src, tag=SETUP_TAG)
            return out
        return None

    def gather_busy(self, reset: bool) -> list[tuple[float, float]]:
        """Every rank's (busy seconds, wall seconds) since the last reset, by global rank (every
        rank must call it, with no batch in flight); `reset`: start counting again."""
        self.flush()
        mine = torch.tensor(self.clock.read(), dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.world_cpu_group))]
        dist.all_gather(every, mine, group=self.world_cpu_group)
        if reset:
            self.clock.reset()
        return [(float(t[0]), float(t[1])) for t in every]

    def min_over_world(self, value: int) -> int:
        """The smallest of every rank's `value`, all stages (every rank must call it)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.world_cpu_group)
        return int(t.item())


@dataclass
class StagePlace:
    """What a rank's ModelRunner needs to know of its place: its global rank, its stage's layers,
    its link to the neighbour stages (None: one stage) and the GPU it uses (None: GPU `rank`)."""

    rank: int = 0
    stage: PipelineStage = WHOLE
    link: StageLink | None = None
    device_index: int | None = None

    @property
    def device_rank(self) -> int:
        """The index of this rank's GPU (as its process sees them)."""
        return self.rank if self.device_index is None else self.device_index


SINGLE_STAGE = StagePlace()


def join_stages(rank: int, tp_size: int, pp_size: int, device: str, num_layers: int, hidden_size: int,
                world_cpu: object, expert_parallel: bool = False,
                device_index: int | None = None) -> tuple[TPGroup, StagePlace]:  # fmt: skip
    """After `dist.init_process_group` over all tp_size x pp_size ranks (`world_cpu`: a gloo group
    of them all): every rank makes every stage's tensor-parallel group (torch wants each group
    made by all ranks, in the same order) and gets its own, its stage and its link."""
    place = RankPlace(rank, tp_size, pp_size)
    mine = cpu_mine = None
    for stage in range(pp_size):
        ranks = [place.rank_of(stage, t) for t in range(tp_size)]
        group = dist.new_group(ranks)
        cpu_group = dist.new_group(ranks, backend="gloo") if device == "cuda" else group
        if stage == place.stage:
            mine, cpu_mine = group, cpu_group
    tp = TPGroup(place.tp_rank, tp_size, cpu_mine, expert_parallel, group=mine)
    stage = pipeline_stage(num_layers, pp_size, place.stage)
    return tp, StagePlace(rank, stage, StageLink(place, stage, hidden_size, world_cpu), device_index)


@dataclass(frozen=True, slots=True)
class StageCapture:
    """An EAGLE head's states under pipeline parallelism (every rank knows the head's layers): this
    stage's model keeps those of its own layers in `capture`; `before` of them come from earlier
    stages with the carried tensors, and all go on to the next stage, so the last stage (the
    driver, where the head runs) holds them all, in layer order."""

    capture: HiddenCapture
    before: int


def stage_slots(layer_slot: tuple[int, ...], stage: PipelineStage) -> list[int]:
    """The KV cache slots (engine/kv_layout.py) the stage's layers use, in order: a stage holds a
    cache tensor for these alone."""
    return sorted({layer_slot[i] for i in stage.layers(len(layer_slot))})


def run_stage(model, link: StageLink, input_ids: torch.Tensor, positions: torch.Tensor, meta, sampled,
              dtype: torch.dtype, capture: StageCapture | None = None) -> torch.Tensor | None:  # fmt: skip
    """One step's part of this stage: its layers over the embedding (first stage) or what the
    stage before sent; sent on to the next stage (None returned), or on the last stage the final
    hidden states (of the `sampled` rows alone, if given). `capture`: an EAGLE head's states
    travel with the carried tensors (the earlier stages' first, then this stage's)."""
    began, link.wait_s = time.perf_counter(), 0.0
    carried, before = None, []
    if link.prev is not None:
        got = link.recv(input_ids.shape[0], dtype, input_ids.device, capture.before if capture else 0)
        carried, before = (got[0], got[1]), list(got[2:])
    out = model.forward_stage(input_ids, positions, meta, carried, sampled if link.next is None else None)
    if capture is not None:  # (the model's forward kept this stage's own)
        capture.capture.states = before + capture.capture.states
    if link.next is not None:
        link.send(*out, *(capture.capture.states if capture is not None else ()))
        out = None
    link.clock.busy_s += time.perf_counter() - began - link.wait_s
    return out
