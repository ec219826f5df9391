"""Async scheduling: step N+1 is scheduled and launched before step N's tokens are known.

The reference is the same engine with `async_scheduling=False` (one step at a time):
every output — tokens, finish reasons, log-probabilities — must be identical, and the
scheduler must neither lose nor invent a token when a request stops while the next step
is already running.
"""

from __future__ import annotations

import random

import pytest
from conftest import assert_no_leak
from test_scheduler import make_request, make_scheduler

from llmserve import LLM, SamplingParams
from llmserve.engine.request import PLACEHOLDER, RequestStatus

pytestmark = pytest.mark.unit


def _requests() -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [1] + [rng.randrange(3, 500) for _ in range(n)]} for n in (3, 17, 33, 60, 9, 25)]
    params = [
        SamplingParams(temperature=0, max_tokens=20),  # may stop at EOS
        SamplingParams(temperature=0, max_tokens=1),  # one token: finishes by length at once
        SamplingParams(temperature=0.8, seed=11, max_tokens=12, n=2, logprobs=2),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, min_tokens=5),
        SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3),  # counted on the device
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1),
    ]
    return prompts, params


def _outputs(llm: LLM, prompts, params):
    """Tokens, finish and stop reasons, and logprobs to 4 decimals: a step's batch may hold a
    request that already finished when steps overlap, which moves the float sums of the other
    rows' logits in their last bits."""
    results = llm.generate(prompts, params, use_tqdm=False)
    return [
        [(o.token_ids, o.finish_reason, o.stop_reason,
          [sorted((t, round(v.logprob, 4), v.rank) for t, v in lp.items()) for lp in o.logprobs or []])
         for o in r.outputs]
        for r in results
    ]  # fmt: skip


def test_async_scheduling_gives_the_same_outputs(llama_dir):
    prompts, params = _requests()
    sync = LLM(llama_dir, async_scheduling=False)
    overlapped = LLM(llama_dir)
    assert overlapped.config.async_scheduling and not sync.config.async_scheduling
    expected = _outputs(sync, prompts, params)
    assert _outputs(overlapped, prompts, params) == expected
    # a stop token met mid-stream, while the next step already runs
    free = expected[0][0][0]
    stop = free[len(free) // 2]
    cut = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop])
    assert _outputs(overlapped, prompts[:1], [cut]) == _outputs(sync, prompts[:1], [cut])
    assert_no_leak(sync)
    assert_no_leak(overlapped)


def test_async_scheduling_under_preemption(llama_dir):
    """Few blocks: requests are preempted while their token is still on the device."""
    prompts, _ = _requests()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    opts = {"block_size": 8, "num_gpu_blocks_override": 20, "max_model_len": 128, "admission_reserve_tokens": 0}
    for swap in (0, 0.001):
        sync = LLM(llama_dir, async_scheduling=False, swap_space=swap, **opts)
        overlapped = LLM(llama_dir, swap_space=swap, **opts)
        assert _outputs(overlapped, prompts, params) == _outputs(sync, prompts, params)
        assert overlapped.stats().num_preemptions > 0
        assert_no_leak(overlapped)


def test_a_prompt_reads_blocks_that_the_step_in_flight_is_still_writing(llama_dir):
    """A chunk's full blocks go to the prefix cache when its step is launched. A prompt with the
    same prefix, added while that step is still on the device, is scheduled into the next step,
    reads those blocks from the cache, and gives the tokens of an engine without prefix caching."""
    from llmserve.engine.engine_core import StepPipeline
    from llmserve.engine.request import EngineCoreRequest

    rng = random.Random(5)
    shared = [1] + [rng.randrange(3, 500) for _ in range(71)]
    prompts = {"first": shared + [7, 8, 9], "second": shared + [11, 12]}

    def core_request(llm, rid):
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        return EngineCoreRequest(request_id=rid, prompt_token_ids=prompts[rid], sampling_params=params,
                                 max_tokens=8, eos_token_ids=(2,))  # fmt: skip

    expected = {}
    plain = LLM(llama_dir, block_size=16, enable_prefix_caching=False)
    for rid, ids in prompts.items():
        expected[rid] = plain.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=8,
                                       ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip
    llm = LLM(llama_dir, block_size=16, max_num_batched_tokens=48)  # the first prompt in two chunks
    core = llm.core
    pipeline = StepPipeline(core)
    assert core.add_request(core_request(llm, "first")) is None
    pipeline.launch()  # the first chunk (48 tokens, 3 full blocks) on the device
    assert core.kv.num_cached_blocks(core.scheduler.requests["first"]) == 3
    assert core.add_request(core_request(llm, "second")) is None
    got, cached = {"first": [], "second": []}, {}
    while core.has_unfinished() or pipeline.busy:
        pipeline.launch()  # the next step: launched before the one in flight is finished
        done = pipeline.finish()
        for out in done.outputs if done is not None else ():
            got[out.request_id] += out.new_token_ids
            cached.setdefault(out.request_id, out.num_cached_tokens)
    assert cached["second"] >= 48  # the blocks of the step that was in flight when it arrived
    assert got == expected
    assert_no_leak(llm)


def test_scheduler_overlap_stop_while_next_step_runs():
    sched = make_scheduler()
    sched.add_request(make_request("a", tokens=[1, 5, 6], max_tokens=10))
    first = sched.schedule()
    sched.after_launch(first)
    req = sched.requests["a"]
    assert req.all_token_ids[-1] == PLACEHOLDER and req.num_pending == 1
    second = sched.schedule()  # before the first step's token is known
    assert [s.num_new_tokens for s in second.scheduled] == [1]
    sched.after_launch(second)
    assert req.num_pending == 2
    # the first step sampled EOS (2): the request stops; the second step's token is dropped
    out = sched.update_from_output(first, {"a": 2}, {})
    assert out[0].new_token_ids == [2] and out[0].finish_reason == "stop"
    assert req.all_token_ids == [1, 5, 6, 2] and req.num_pending == 0
    assert sched.update_from_output(second, {"a": 9}, {}) == []
    assert not sched.has_unfinished() and sched.kv.pool.num_used == 0


def test_scheduler_overlap_does_not_schedule_past_max_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("a", tokens=[1, 5, 6], max_tokens=2))
    steps = []
    for _ in range(2):
        out = sched.schedule()
        sched.after_launch(out)
        steps.append(out)
    assert len(steps[1].scheduled) == 1
    third = sched.schedule()  # two tokens in flight = max_tokens: nothing more to run
    assert third.scheduled == []
    assert sched.update_from_output(steps[0], {"a": 7}, {})[0].finish_reason is None
    last = sched.update_from_output(steps[1], {"a": 8}, {})
    assert last[0].finish_reason == "length"
    assert sched.requests == {} and RequestStatus.FINISHED_LENGTH.finished


def test_step_timing_log(llama_dir, tmp_path):
    """`step_timing_log`: one line per step, in order; the first step holds every prompt
    (all new, all prefill), the rest one-token decodes; each step's times ascend, and
    with the overlap a step is launched before the one ahead of it is done."""
    import json

    path = tmp_path / "steps.jsonl"
    llm = LLM(llama_dir, max_model_len=256, max_num_batched_tokens=256, step_timing_log=str(path))
    lens, new_tokens = (5, 9, 14), 6
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in lens]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(steps) == new_tokens  # the prompts' step samples the first token, then 5 decodes
    assert steps[0] | {"launch": 0, "launched": 0, "done": 0} == {
        "launch": 0,
        "launched": 0,
        "done": 0,
        "reqs": 3,
        "new": 3,
        "tokens": sum(lens),
        "prefill": sum(lens),
        "waiting": 0,
    }
    for s in steps[1:]:
        assert (s["reqs"], s["new"], s["tokens"], s["prefill"], s["waiting"]) == (3, 0, 3, 0, 0)
    assert all(s["launch"] <= s["launched"] <= s["done"] for s in steps)
    assert all(a["launch"] <= b["launch"] and a["done"] <= b["done"] for a, b in zip(steps, steps[1:]))
    assert any(b["launched"] <= a["done"] for a, b in zip(steps, steps[1:]))  # overlapped
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # appends to the same file
    assert len(path.read_text().splitlines()) == new_tokens + 2


def test_step_timing_log_in_a_missing_folder_is_a_config_error(llama_dir, tmp_path):
    import pytest

    from llmserve.config import ConfigError, EngineArgs

    with pytest.raises(ConfigError, match="does not exist"):
        EngineArgs(llama_dir, step_timing_log=str(tmp_path / "nope" / "steps.jsonl")).create_engine_config()


def test_penalties_overlap_and_equal_the_reference_sampler(llama_dir):
    """Penalties no longer force one step at a time: with the batched sampler (penalty
    counts grown on the device) steps overlap, and every output equals the reference
    sampler's run one step at a time, seeded sampling and logprobs included."""
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [1] + [rng.randrange(3, 500) for _ in range(n)]} for n in (5, 21, 40, 13)]
    params = [
        SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=7, max_tokens=24, presence_penalty=0.6, frequency_penalty=0.3, logprobs=2),
        SamplingParams(temperature=0.8, seed=8, top_k=20, top_p=0.9, max_tokens=24, repetition_penalty=1.2, n=2),
        SamplingParams(temperature=1.0, seed=9, min_p=0.1, max_tokens=24, logit_bias={17: 3.0}, min_tokens=6),
    ]
    reference = LLM(llama_dir, async_scheduling=False, sampler="reference")
    batched = LLM(llama_dir)
    overlapped = []
    original = batched.core.can_overlap

    def watch():  # asked only while a step is in flight: True launches the next one
        allowed = original()
        overlapped.append(allowed and any(r.sampling_params.has_penalties for r in batched.core.scheduler.running))
        return allowed

    batched.core.can_overlap = watch
    assert _outputs(batched, prompts, params) == _outputs(reference, prompts, params)
    assert sum(overlapped) > 10  # steps with penalised requests ran overlapped
    assert_no_leak(reference)
    assert_no_leak(batched)
