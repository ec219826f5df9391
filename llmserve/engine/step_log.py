"""`--step-timing-log PATH`: one JSON line per engine step, written by the engine core, for
reading a latency tail step by step (with the server's `--request-timing-log`):

    launch    wall clock when the core began to schedule the step
    launched  when the step was on the device (scheduling and launch done: host time)
    done      when its sampled tokens were back on the host
    reqs      requests in the step;  new: of them, scheduled for the first time
    tokens    tokens in the step;    prefill: of them, in prompt chunks (not one-token decodes)
    waiting   requests still waiting after it was scheduled

Steps finish in launch order (at most two are in flight), so `done` is matched FIFO. A
step with nothing to run (the requests it would continue had just finished) is left out.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from llmserve.engine.scheduler import SchedulerOutput


class StepTimingLog:
    def __init__(self, path: str | Path) -> None:
        self._file = Path(path).open("a", buffering=1, encoding="utf-8")  # line-buffered: survives a kill
        self._in_flight: deque[dict] = deque()

    def launched(self, sched: SchedulerOutput, began: float, num_waiting: int) -> None:
        new = sum(1 for s in sched.scheduled if (s.request.first_scheduled_time or 0.0) >= began)
        prefill = sum(s.num_new_tokens for s in sched.scheduled if s.num_new_tokens > 1)
        self._in_flight.append({"launch": began, "launched": time.time(), "reqs": len(sched.scheduled), "new": new,
                                "tokens": sched.num_batched_tokens, "prefill": prefill, "waiting": num_waiting,
                                "empty": sched.is_empty})  # fmt: skip

    def finished(self) -> None:
        if self._in_flight and not self._file.closed:
            step = self._in_flight.popleft()
            if step.pop("empty"):
                return  # nothing ran (e.g. every request had finished in the step before)
            step["done"] = time.time()
            self._file.write(json.dumps(step) + "\n")

    def close(self) -> None:
        self._file.close()


@contextlib.contextmanager
def step_timing_log(path: str | None) -> Iterator[StepTimingLog | None]:
    """The log at `path` (EngineConfig.step_timing_log), closed on exit; None without a path."""
    if path is None:
        yield None
        return
    log = StepTimingLog(path)
    try:
        yield log
    finally:
        log.close()
