"""The scheduler-to-runner boundary as data (llmserve/engine/step_plan.py): the plan carries no
`Request`; a request arrives whole the first time and after a preemption, then only as its new
blocks; the runner's own token state mirrors the scheduler's, placeholders included, through a
whole run with preemptions; finished requests are forgotten on both sides."""

from __future__ import annotations

import dataclasses

import pytest

from llmserve.engine.request import PLACEHOLDER
from llmserve.engine.step_plan import NewRequest, PlanBuilder, PlannedRow, RunnerRequests, StepPlan
from llmserve.sampling_params import SamplingParams
from tests.test_scheduler import make_request, make_scheduler

pytestmark = pytest.mark.unit

PLAIN = (str, int, float, bool, type(None), SamplingParams)


def assert_plain(value, path="plan"):
    """Only plain values, lists, tuples and the plan's own dataclasses: no live engine object."""
    if isinstance(value, PLAIN):  # (SamplingParams: the request's own settings, plain data too)
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            assert_plain(item, f"{path}[{i}]")
    elif dataclasses.is_dataclass(value):
        assert type(value) in (StepPlan, PlannedRow, NewRequest), f"{path}: {type(value).__name__}"
        for f in dataclasses.fields(value):
            assert_plain(getattr(value, f.name), f"{path}.{f.name}")
    else:
        raise AssertionError(f"{path}: {type(value).__name__}")


def test_a_request_arrives_whole_once_then_as_its_new_blocks():
    sched, plans = make_scheduler(num_blocks=16, budget=64), PlanBuilder()
    sched.add_request(make_request("a", prompt_len=6, max_tokens=8))
    out = sched.schedule()
    plan = plans.plan(out)
    assert_plain(plan)
    (row,) = plan.rows
    assert row.new is not None and row.new.prompt_token_ids == out.scheduled[0].request.prompt_token_ids
    assert row.new.block_ids == out.scheduled[0].block_table and row.new.block_ids is not out.scheduled[0].block_table
    assert list(row.new_block_ids) == [] and row.num_computed_tokens == 0 and row.num_new_tokens == 6 and row.samples
    sched.after_launch(out)
    sched.update_from_output(out, {"a": 7}, {})
    out = sched.schedule()  # position 6: still in the second block (4 tokens a block)
    (row,) = plans.plan(out).rows
    assert row.new is None and list(row.new_block_ids) == [] and row.num_computed_tokens == 6
    sched.after_launch(out)
    sched.update_from_output(out, {"a": 8}, {})
    out = sched.schedule()  # position 7
    sched.after_launch(out)
    sched.update_from_output(out, {"a": 9}, {})
    out = sched.schedule()  # position 8: a third block
    (row,) = plans.plan(out).rows
    assert row.new is None and row.new_block_ids == out.scheduled[0].block_table[2:] and len(row.new_block_ids) == 1


def test_the_runner_state_mirrors_the_scheduler_through_preemptions():
    """A whole run with recompute preemptions, the runner fed only plans (and the sampled
    tokens): before each step its tokens and blocks for each row equal the scheduler's."""
    sched, plans, runner = make_scheduler(num_blocks=6, budget=64, reserve=0), PlanBuilder(), RunnerRequests()
    sched.watermark = 0
    for rid, arrival in (("a", 0), ("b", 1), ("c", 2)):
        sched.add_request(make_request(rid, prompt_len=8, max_tokens=6, arrival=arrival))
    restarts, steps, token = 0, 0, 20
    while sched.has_unfinished() and steps < 200:
        steps += 1
        out = sched.schedule()
        plan = plans.plan(out)
        assert_plain(plan)
        rows, sampling = runner.rows_for(plan)
        for s, row in zip(out.scheduled, rows):
            assert row.token_ids == s.request.all_token_ids and row.block_ids == s.block_table
            assert (row.start, row.count, row.samples) == (s.request.num_computed_tokens, s.num_new_tokens, s.samples)
            assert runner.requests[row.request_id].num_output_tokens == s.request.num_output_tokens
        assert [x.request_id for x in sampling] == [s.request.request_id for s in out.scheduled if s.samples]
        restarts += sum(1 for row in plan.rows if row.new is not None and row.new.output_token_ids)
        runner.hold_places(sampling)
        sched.after_launch(out)
        sampled = {s.request.request_id: token + i for i, s in enumerate(out.scheduled) if s.samples}
        token += 10
        runner.fill(sampling, [sampled[x.request_id] for x in sampling])
        sched.update_from_output(out, sampled, {})
        for s in out.scheduled:
            state = runner.requests.get(s.request.request_id)
            if state is not None and not s.request.status.finished:
                assert state.token_ids == s.request.all_token_ids and PLACEHOLDER not in state.token_ids
    assert not sched.has_unfinished() and sched.num_preemptions >= 1
    assert restarts >= 1  # a preempted request came back whole, with the tokens it had sampled
    runner.forget(plans.plan(sched.schedule()).finished_request_ids)
    assert runner.requests == {}
    assert plans._sent == {}


def test_tokens_still_on_the_device_are_placeholders_until_filled():
    runner = RunnerRequests()
    new = NewRequest("r", [1, 2, 3], [], SamplingParams(), (2,), [5])
    rows, sampling = runner.rows_for(StepPlan([PlannedRow("r", 0, 3, True, [], new)]))
    assert [(r.start, r.count) for r in rows] == [(0, 3)] and rows[0].token_ids == [1, 2, 3]
    runner.hold_places(sampling)
    rows2, sampling2 = runner.rows_for(StepPlan([PlannedRow("r", 3, 1, True, [6])]))  # before the first token is known
    state = runner.requests["r"]
    assert sampling2 == [state] and rows2[0].token_ids == [1, 2, 3, PLACEHOLDER] and rows2[0].block_ids == [5, 6]
    runner.hold_places(sampling2)
    runner.fill(sampling, [40])
    assert state.token_ids == [1, 2, 3, 40, PLACEHOLDER] and state.output_token_ids == [40, PLACEHOLDER]
    runner.fill(sampling2, [41])
    assert state.token_ids == [1, 2, 3, 40, 41] and state.pending == []
    runner.rows_for(StepPlan(finished_request_ids=["r"]))
    assert runner.requests == {}


def test_a_late_token_goes_to_the_request_that_sampled_it_not_to_a_new_one_with_its_id():
    """Steps overlap: "r" finishes while a step that holds it is still on the device, and a new
    request takes the id "r" and is launched before that step's tokens arrive. The old step's
    token must not land in the new request's place."""
    runner = RunnerRequests()
    old = NewRequest("r", [1, 2], [], SamplingParams(), (2,), [5])
    _, sampling = runner.rows_for(StepPlan([PlannedRow("r", 0, 2, True, [], old)]))
    runner.hold_places(sampling)  # the old request's step, in flight
    fresh = NewRequest("r", [7, 8, 9], [], SamplingParams(), (2,), [6])
    _, sampling2 = runner.rows_for(StepPlan([PlannedRow("r", 0, 3, True, [], fresh)], finished_request_ids=["r"]))
    runner.hold_places(sampling2)
    new_state = runner.requests["r"]
    runner.fill(sampling, [50])  # the old step's token arrives
    assert new_state.token_ids == [7, 8, 9, PLACEHOLDER] and sampling[0].token_ids == [1, 2, 50]
    runner.fill(sampling2, [60])
    assert new_state.token_ids == [7, 8, 9, 60]
