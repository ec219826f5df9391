"""Queueing an offline batch into the engine core while the device already runs its first steps.

`LLM.generate` checks every prompt before any is queued, then used to queue them all before
the first step: for 1000 prompts of 1,024 tokens that was hundreds of milliseconds of host
work with the GPU idle. The feed queues a few steps' worth of prompt tokens first, then one
step's worth after each launch, while the device runs it. Every step still finds more than a
step's worth of prompt tokens waiting (LEAD_STEPS - 1 steps ahead), so the scheduler, which
takes waiting requests first come first served until a step's budget (tokens, sequences, KV
blocks) is spent, schedules exactly what it would with the whole batch queued. Where order is
not first come first served (different priorities, LoRA adapters, which the scheduler may
take out of order), everything is queued at once, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from llmserve.engine.input_processor import ProcessedRequest
from llmserve.engine.output_processor import RequestFailedError
from llmserve.engine.request import EngineCoreOutput, EngineCoreRequest

LEAD_STEPS = 4  # a step's worth of prompt tokens queued first, times this


class RequestFeed:
    """The processed requests of one `generate` call, queued in order by `add` (the core's
    `add_request`: None, or the refusal that fails the call)."""

    def __init__(self, requests: Sequence[ProcessedRequest], add: Callable[[EngineCoreRequest], EngineCoreOutput | None],
                 step_tokens: int, in_order: bool) -> None:  # fmt: skip
        self._requests = list(requests)
        self._add = add
        self._step_tokens = step_tokens
        self._in_order = in_order
        self._next = 0

    @property
    def done(self) -> bool:
        return self._next >= len(self._requests)

    def start(self) -> None:
        """Queue the first requests: LEAD_STEPS steps' worth of prompt tokens (all, when the
        scheduler may take them out of order)."""
        self._queue(LEAD_STEPS * self._step_tokens if self._in_order else None)

    def more(self) -> None:
        """Queue one more step's worth (at least one request), if any are left."""
        if not self.done:
            self._queue(self._step_tokens)

    def _queue(self, tokens: int | None) -> None:
        queued = 0
        while not self.done and (tokens is None or queued < tokens):
            p = self._requests[self._next]
            self._next += 1
            for core_req in p.core_requests:  # the n samples of one prompt together
                error = self._add(core_req)
                if error is not None:
                    raise RequestFailedError(error.error)
                queued += len(core_req.prompt_token_ids)
