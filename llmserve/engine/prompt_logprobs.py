"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's logprob given the tokens
before it, its rank and the top k at its position, computed on the device from the logits of
a step's prompt rows by the sampled logprobs' own path (`sampler.raw_logprobs`).

The hidden row of position p predicts token p + 1, so a chunk [start, start + count) of a
prompt of P tokens gives the prompt positions start + 1 .. min(start + count, P - 1) (the row
of P - 1 samples the first output token). Only the requests that ask are looked at: a step
without one does no work here (the runner keeps their ids, `RunnerRequests.prompt_logprobs`).
The LM head runs on at most ROWS_AT_ONCE of the rows at a time (and no more than a step's
sampling rows, whose padded counts the warm-up ran), so a long chunk's logits take no more
memory than a batch of sampling rows. Positions come back by request as (first
position, entries); a request recomputed after a preemption gives some again, and the core
keeps each position once (`Scheduler.update_from_output`).

Reference: the log-softmax of a whole forward's logits over the prompt
(tests/test_prompt_logprobs.py, against transformers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from llmserve.engine.input_builder import RowInput
from llmserve.engine.logits_rows import step_logits
from llmserve.engine.request import TokenLogprobs
from llmserve.engine.sampler import raw_logprobs
from llmserve.engine.sampler_output import SampledLogprobs
from llmserve.host_copy import to_device

ROWS_AT_ONCE = 256  # prompt rows whose logits are made at once


@dataclass(slots=True)
class PromptRows:
    """A step's hidden rows whose logits give prompt logprobs, and what each gives."""

    rows: list[int] = field(default_factory=list)  # flat hidden rows of the step
    targets: list[int] = field(default_factory=list)  # the prompt token each row predicts
    ks: list[int] = field(default_factory=list)  # top logprobs each row shows
    spans: list[tuple[str, int, int]] = field(default_factory=list)  # (request id, first position, count)


def prompt_rows(rows: list[RowInput], query_start: list[int], asking: dict[str, tuple[int, int]]) -> PromptRows | None:
    """The rows of `rows` (a step's, flattened at `query_start`) that give prompt logprobs to
    the requests `asking` (request id -> (prompt length, k)); None when none does. A request
    whose prompt this step completes leaves `asking`."""
    out = PromptRows()
    for i, row in enumerate(rows):
        asked = asking.get(row.request_id)
        if asked is None:
            continue
        prompt_len, k = asked
        if row.start + row.count >= prompt_len - 1:
            del asking[row.request_id]
        end = min(row.start + row.count, prompt_len - 1)
        if end <= row.start:
            continue
        first = query_start[i]
        out.rows.extend(range(first, first + end - row.start))
        out.targets.extend(row.token_ids[row.start + 1 : end + 1])
        out.ks.extend([k] * (end - row.start))
        out.spans.append((row.request_id, row.start + 1, end - row.start))
    return out if out.rows else None


def compute_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                            plan: PromptRows, use_kernels: bool, pad: bool,
                            max_rows: int = ROWS_AT_ONCE) -> PendingPromptLogprobs:  # fmt: skip
    """Queue the logprobs of `plan`'s rows of `hidden` (the step's final hidden states, every row);
    `.result()` reads them. `pad`: the LM head's row counts padded as a step's (logits_rows.py);
    `max_rows`: rows a time (at most ROWS_AT_ONCE)."""
    parts = []
    step = max(1, min(max_rows, ROWS_AT_ONCE))
    for a in range(0, len(plan.rows), step):
        rows = plan.rows[a : a + step]
        logits = step_logits(compute_logits, hidden, rows, pad)
        targets = to_device(plan.targets[a : a + step], torch.long, hidden.device)
        parts.append(raw_logprobs(logits, targets, plan.ks[a : a + step], use_kernels))
    return PendingPromptLogprobs(plan.spans, parts, hidden.is_cuda)


class PendingPromptLogprobs:
    """Prompt logprobs on their way from the device (a step may have them and sample nothing)."""

    def __init__(self, spans: list[tuple[str, int, int]], parts: list[SampledLogprobs], cuda: bool) -> None:
        self.spans, self.parts = spans, parts
        self.event = None
        if cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """Request id -> (its first prompt position here, the entries of its positions from there)."""
        if self.event is not None:
            self.event.synchronize()
        entries: list[TokenLogprobs] = []
        for part in self.parts:
            entries.extend(part.result(len(part.ks)))
        out, at = {}, 0
        for request_id, first, count in self.spans:
            out[request_id] = (first, entries[at : at + count])
            at += count
        return out
