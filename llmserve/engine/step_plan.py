"""What the model runner is told about a step: plain data, no `Request` (issue 20).

The scheduler works on live `Request`s; `PlanBuilder` (core side) turns its `SchedulerOutput`
into a `StepPlan`. A request the runner has not seen, or one resumed after a preemption (its
blocks and computed tokens are new), arrives whole as a `NewRequest`; a running one as its
new block ids and counts only. The runner keeps each request's tokens and blocks itself
(`RunnerRequests`) and fills in the tokens it samples. A grammar's constraint crosses as data
too: the bitmask rows of the step's sampling requests, filled on the core side before launch
(steps with a grammar never overlap, so the matcher is current then).

    core:   Scheduler.schedule() -> SchedulerOutput (Requests) -> PlanBuilder.plan() -> StepPlan
    runner: StepPlan -> RunnerRequests.rows_for() -> RowInputs, the sampler's rows
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmserve.engine.input_builder import RowInput
from llmserve.engine.request import PLACEHOLDER, Request
from llmserve.engine.scheduler import SchedulerOutput
from llmserve.engine.structured_output import GrammarMask, grammar_mask
from llmserve.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequest:
    """A request as the runner first sees it (or sees it again after a preemption)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # sampled before (a resumed request); all known on the host
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    block_ids: list[int]  # a copy


@dataclass(slots=True)
class PlannedRow:
    """One scheduled request's part of a step."""

    request_id: str
    num_computed_tokens: int  # before this step
    num_new_tokens: int
    samples: bool  # the step reaches its last token: a token is sampled
    new_block_ids: list[int] | tuple[()]  # blocks allocated since the runner last heard of it
    new: NewRequest | None = None  # set when the runner starts (or restarts) this request
    has_grammar: bool = False
    # speculative decoding: the tokens proposed after the last one, computed with it this step; the
    # runner verifies them against the step's logits (engine/spec_decode.py)
    draft_token_ids: list[int] | tuple[()] = ()
    draft_probs: Any = None  # [k, V] their draft distributions (a draft model's, on the device); None: n-gram's


@dataclass(slots=True)
class StepPlan:
    rows: list[PlannedRow] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # the runner forgets these
    grammar: GrammarMask | None = None  # the grammars' allowed tokens, rows of the sampling requests
    kv_offload: list[tuple[int, int]] = field(default_factory=list)  # host tier: (device, host), first
    kv_load: list[tuple[int, int]] = field(default_factory=list)  # then (host, device)
    kv_spill: list[tuple] = field(default_factory=list)  # disk tier: (on host, block, slot, header), before them
    kv_disk_load: list[tuple[int, int]] = field(default_factory=list)  # (stage id, device block), last


class PlanBuilder:
    """Core side: what the runner already knows of each request (the preemption count it saw
    and how many of its block ids were sent), so each step sends only what is new."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[int, int]] = {}  # request id -> (num_preemptions, blocks sent)

    def plan(self, out: SchedulerOutput, vocab_size: int | None = None) -> StepPlan:
        sent = self._sent
        for rid in out.finished_request_ids:
            sent.pop(rid, None)
        rows: list[PlannedRow] = []
        append = rows.append
        grammar = False
        for sched in out.scheduled:  # (every step, every request: kept lean)
            req = sched.request
            rid = req.request_id
            blocks = sched.block_table
            n = len(blocks)
            preemptions = req.num_preemptions
            known = sent.get(rid)
            if known is not None and known[0] == preemptions:
                new = None
                new_blocks = blocks[known[1] :] if n > known[1] else ()
                if n != known[1]:
                    sent[rid] = (preemptions, n)
            else:
                new = NewRequest(rid, list(req.prompt_token_ids), _known_outputs(req), req.sampling_params,
                                 tuple(req.eos_token_ids), list(blocks))  # fmt: skip
                new_blocks = ()
                sent[rid] = (preemptions, n)
            has_grammar = req.matcher is not None
            grammar = grammar or (has_grammar and sched.samples)
            append(PlannedRow(rid, req.num_computed_tokens, sched.num_new_tokens, sched.samples, new_blocks, new,
                              has_grammar, sched.draft_token_ids, sched.draft_probs))  # fmt: skip
        plan = StepPlan(rows, out.blocks_to_swap_out, out.blocks_to_swap_in, list(out.finished_request_ids))
        if out.kv_offload or out.kv_load:
            plan.kv_offload, plan.kv_load = out.kv_offload, out.kv_load
        if out.kv_spill or out.kv_disk_load:
            plan.kv_spill, plan.kv_disk_load = out.kv_spill, out.kv_disk_load
        if grammar and vocab_size is not None:
            plan.grammar = grammar_mask([s.request for s in out.scheduled if s.samples], vocab_size)
        return plan

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._sent.pop(rid, None)


def _known_outputs(req: Request) -> list[int]:
    out = req.all_token_ids[len(req.prompt_token_ids) :]
    assert PLACEHOLDER not in out, f"request {req.request_id} restarts with a token still on the device"
    return list(out)


@dataclass(slots=True)
class RunnerRequest:
    """The runner's own state of one request: what the sampler reads of it, and its tokens
    (PLACEHOLDER where a token sampled by a running step is not yet on the host)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    token_ids: list[int]
    block_ids: list[int]
    has_grammar: bool = False
    pending: list[int] = field(default_factory=list)  # indices of PLACEHOLDERs, oldest first

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]


class RunnerRequests:
    """Runner side: every running request's state, kept from step to step."""

    def __init__(self) -> None:
        self.requests: dict[str, RunnerRequest] = {}
        # requests whose prompt logprobs are still to compute: id -> (prompt length, k); empty
        # but for requests that ask (engine/prompt_logprobs.py)
        self.prompt_logprobs: dict[str, tuple[int, int]] = {}

    def rows_for(self, plan: StepPlan) -> tuple[list[RowInput], list[RunnerRequest]]:
        """Apply a step's plan (`update`) and flatten it in the same pass: the input builder's
        rows, and the states of the rows that sample (in order; a speculating row's state is not
        among them: its logits rows are verified, `RowInput.drafts`)."""
        self.forget(plan.finished_request_ids)
        requests = self.requests
        rows: list[RowInput] = []
        sampling: list[RunnerRequest] = []
        for row in plan.rows:
            n = row.new
            if n is None:
                state = requests[row.request_id]
                if row.new_block_ids:
                    state.block_ids.extend(row.new_block_ids)
            else:
                state = RunnerRequest(n.request_id, n.prompt_token_ids, n.sampling_params, n.eos_token_ids,
                                      n.prompt_token_ids + n.output_token_ids, n.block_ids)  # fmt: skip
                requests[row.request_id] = state
                if n.sampling_params.prompt_logprobs is not None:
                    self.prompt_logprobs[row.request_id] = (len(n.prompt_token_ids), n.sampling_params.prompt_logprobs)
            state.has_grammar = row.has_grammar
            if row.draft_token_ids:  # its input: the last token, then the proposals
                rows.append(RowInput(row.request_id, state.block_ids, row.num_computed_tokens, row.num_new_tokens,
                                     state.token_ids + list(row.draft_token_ids), True, tuple(row.draft_token_ids),
                                     row.draft_probs))  # fmt: skip
                continue
            rows.append(RowInput(row.request_id, state.block_ids, row.num_computed_tokens, row.num_new_tokens,
                                 state.token_ids, row.samples))  # fmt: skip
            if row.samples:
                sampling.append(state)
        return rows, sampling

    @staticmethod
    def hold_places(sampling: list[RunnerRequest]) -> None:
        """After the step is launched and sampled: each sampling row holds a PLACEHOLDER for its
        token until the step's result (`fill`)."""
        for state in sampling:
            state.pending.append(len(state.token_ids))
            state.token_ids.append(PLACEHOLDER)

    @staticmethod
    def fill(sampling: list[RunnerRequest], tokens: list[int]) -> None:
        """A step's sampled tokens, now on the host, in place of their PLACEHOLDERs: into the very
        states that sampled them, not by id. A request finished meanwhile writes into its own
        forgotten state, never into a new request that took its id since."""
        for state, token in zip(sampling, tokens):
            if state.pending:
                state.token_ids[state.pending.pop(0)] = token

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)
        if self.prompt_logprobs:
            for rid in request_ids:
                self.prompt_logprobs.pop(rid, None)
