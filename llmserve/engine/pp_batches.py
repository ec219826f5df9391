"""Pipeline parallelism with several batches in flight (vLLM's batch queue).

With one batch at a time a stage of P works 1/P of the time: the first stage waits while the
later ones run the step, and so on. Here up to `EngineConfig.pipeline_batches_in_flight` batches
(default P) move through the stages at once: while the last stage (the engine core's own
runner) runs batch N, the first stage already runs batch N+1.

- **Disjoint batches.** The scheduler (`Scheduler.in_flight`) never schedules a request that is
  in a batch still in flight, and caps each batch at its share of the live requests, so that P
  batches of about equal size alternate. A batch's sampled tokens are applied when its last
  stage returns, oldest batch first.
- **Order.** Every rank runs its batches in launch order (its calls come over one connection,
  read in order), so a block freed while a batch is in flight (an abort) and reused by a later
  batch is written by the earlier batch first on every stage; the hand-over between stages is
  tagged with the batch's sequence number (`StepInputs.seq`: gloo matches a receive with the
  send of the same tag; NCCL ignores tags and keeps each link's order).
- **The driver.** Launching a batch mirrors it to the workers at once; the driver's own part (the
  last stage's layers and the sampling) runs when the batch is finished (`DeferredStep`).

`BatchQueue` drives an EngineCore with these batches (the step loop's `launch` / `finish`, as
`StepPipeline` does with one or two steps); `BatchQueueCounts` says how many batches really
overlapped; `StageBusy` is one rank's share of wall time spent computing (the bubble's measure).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class BatchQueueCounts:
    """Batches launched so far under the batch queue, and how many of them overlapped."""

    launched: int = 0
    overlapped: int = 0  # launched while another batch was still in flight
    peak: int = 0  # most batches in flight at once


@dataclass(frozen=True, slots=True)
class StageBusy:
    """One rank's time in its stage's forward (its layers, not waiting for the stage before or
    after) over the wall time since the count was reset."""

    stage: int
    tp_rank: int
    busy_s: float
    wall_s: float

    @property
    def fraction(self) -> float:
        return self.busy_s / self.wall_s if self.wall_s > 0 else 0.0


def busy_line(stages: list[StageBusy]) -> str:
    """`pp stage busy: stage 0 0.91, stage 1 0.88 (of 12.3 s)`; a stage's tensor ranks as s.t."""
    many = any(s.tp_rank for s in stages)
    parts = [f"stage {s.stage}{f'.{s.tp_rank}' if many else ''} {s.fraction:.2f}"
             for s in sorted(stages, key=lambda s: (s.stage, s.tp_rank))]  # fmt: skip
    wall = max((s.wall_s for s in stages), default=0.0)
    return f"pp stage busy: {', '.join(parts)} (of {wall:.1f} s)"


class StageClock:
    """A rank's busy time in its stage: the forward's time less the waits on its links."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.since = time.perf_counter()
        self.busy_s = 0.0

    def read(self) -> tuple[float, float]:
        return self.busy_s, time.perf_counter() - self.since


class DeferredStep:
    """A batch launched on the driver under pipeline parallelism: the workers have it; the
    driver's own part (the last stage and the sampling) runs at `result()`, once the older
    batches are done. `run` gives the step whose result it is (a PendingStep)."""

    def __init__(self, run: Callable[[], Any]) -> None:
        self._run: Callable[[], Any] | None = run
        self._result = None

    def result(self):
        if self._run is not None:
            run, self._run = self._run, None
            self._result = run().result()
        return self._result


class BatchQueue:
    """Drives an EngineCore with up to `depth` batches in flight: `launch()` schedules a new batch
    while there is room and something to run, `finish()` completes the oldest once the queue is
    full or nothing more could be launched (None otherwise: the loop launches again first). The
    same interface as `StepPipeline` (engine_core.py)."""

    def __init__(self, core, depth: int, counts: BatchQueueCounts, step_log=None) -> None:
        self.core = core
        self.depth = depth
        self.counts = counts
        self.step_log = step_log
        self.queue: deque = deque()
        self._launched = False

    @property
    def busy(self) -> bool:
        return bool(self.queue)

    def launch(self) -> None:
        self._launched = False
        if len(self.queue) >= self.depth or not self.core.has_unfinished():
            return
        began = time.time()
        step = self.core.launch()
        if step[1] is None and self.queue:
            return  # nothing new can run until a batch comes back (its refusals wait for the next finish)
        c = self.counts
        if self.queue:
            c.overlapped += 1
        self.queue.append(step)
        c.launched += 1
        c.peak = max(c.peak, len(self.queue))
        self._launched = True
        if self.step_log is not None:
            self.step_log.launched(step[0], began, len(self.core.scheduler.waiting))

    def finish(self):
        """The outputs of the oldest batch, or None (nothing in flight, or room for another)."""
        if not self.queue or (self._launched and len(self.queue) < self.depth):
            return None
        done = self.core.finish(self.queue.popleft())
        if self.step_log is not None:
            self.step_log.finished()
        return done
