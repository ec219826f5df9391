"""Pipeline parallelism with several batches in flight (engine/pp_batches.py).

Unit: the scheduler's batch queue takes only requests no batch in flight holds, splits the live
requests into about equal batches, never preempts a request in flight, and an abort mid-flight
frees its blocks at once while its batch's token is dropped. Integration (CPU, gloo, a 3-layer
float32 model): PP=2 and TP=2 x PP=2 with 2 batches in flight give the single process's greedy
tokens for many concurrent requests with chunked prefill, stop tokens and length limits, and the
counters show that batches really overlapped; one in flight (the setting off) gives them too;
aborts while batches are in flight leave no block behind; the stages' busy times are read. (A
stage worker that dies still fails the engine within seconds: tests/test_pipeline_parallel.py, whose
engines run with the default, P batches in flight.)
"""

from __future__ import annotations

import random

import pytest
from test_scheduler import make_request, make_scheduler

from llmserve import LLM, EngineArgs, SamplingParams
from llmserve.config import ConfigError
from llmserve.engine.engine_core import step_pipeline
from llmserve.engine.pp_batches import StageBusy, busy_line
from llmserve.engine.request import EngineCoreRequest, RequestStatus
from llmserve.model.random_model import make_random_model


def _queued(num_blocks=64, budget=64, max_seqs=8, **kw):
    sched = make_scheduler(num_blocks=num_blocks, budget=budget, max_seqs=max_seqs, **kw)
    sched.batches_in_flight, sched.in_flight = 2, set()  # (as Scheduler(..., batches_in_flight=2) sets them)
    return sched


def _ids(out) -> set[str]:
    return {s.request.request_id for s in out.scheduled}


@pytest.mark.unit
def test_batches_hold_disjoint_requests_of_about_equal_size():
    sched = _queued()
    for i in range(6):
        sched.add_request(make_request(f"r{i}", prompt_len=4, max_tokens=3, arrival=i))
    a = sched.schedule()
    sched.after_launch(a)
    b = sched.schedule()
    sched.after_launch(b)
    assert len(a.scheduled) == 3 and len(b.scheduled) == 3  # 6 live requests, 2 batches
    assert not _ids(a) & _ids(b) and sched.in_flight == _ids(a) | _ids(b)
    assert sched.schedule().is_empty  # every request is in flight: nothing is scheduled twice
    sched.update_from_output(a, {rid: 7 for rid in _ids(a)}, {})
    assert sched.in_flight == _ids(b)
    c = sched.schedule()  # a's requests come back for their next token; b's stay out
    assert _ids(c) == _ids(a) and all(s.num_new_tokens == 1 for s in c.scheduled)


@pytest.mark.unit
def test_no_preemption_of_a_request_in_flight():
    # 6 blocks of 4 tokens: three 8-token prompts fill them; a decode then needs a third block
    sched = _queued(num_blocks=6, reserve=0)
    sched.watermark = 0
    for i, name in enumerate("abc"):
        sched.add_request(make_request(name, prompt_len=8, max_tokens=6, arrival=i))
    first = sched.schedule()  # a and b (a cap of 2: 3 live requests, 2 batches)
    sched.after_launch(first)
    second = sched.schedule()  # c
    sched.after_launch(second)
    assert _ids(first) == {"a", "b"} and _ids(second) == {"c"} and sched.kv.pool.num_free == 0
    sched.update_from_output(first, {"a": 7, "b": 7}, {})
    third = sched.schedule()  # a needs a block: the victim is b, not c (the latest, but in flight)
    assert _ids(third) == {"a"} and sched.requests["b"].status == RequestStatus.PREEMPTED
    assert sched.requests["c"].status == RequestStatus.RUNNING and sched.in_flight == {"c"}


@pytest.mark.unit
def test_abort_in_flight_frees_blocks_and_drops_its_token():
    sched = _queued()
    for i in range(2):
        sched.add_request(make_request(f"r{i}", prompt_len=6, max_tokens=4, arrival=i))
    a = sched.schedule()
    sched.after_launch(a)
    (rid,) = _ids(a)
    assert sched.abort_requests([rid]) == [rid] and sched.kv.num_allocated_blocks(rid) == 0
    outs = sched.update_from_output(a, {rid: 7}, {})
    assert outs == [] and not sched.in_flight  # the batch came back: nothing of it goes out
    assert rid in sched.schedule().finished_request_ids


@pytest.mark.unit
def test_batches_in_flight_setting_and_busy_line():
    assert busy_line([StageBusy(1, 0, 3.0, 4.0), StageBusy(0, 0, 2.0, 4.0)]) == (
        "pp stage busy: stage 0 0.50, stage 1 0.75 (of 4.0 s)"
    )


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory) -> str:
    return str(make_random_model(tmp_path_factory.mktemp("ppb") / "llama3", "llama", seed=1, num_hidden_layers=3))


@pytest.mark.integration
def test_batches_in_flight_setting(three_layers):
    def config(**kw):
        return EngineArgs(model=three_layers, **kw).create_engine_config()

    assert config(pipeline_parallel_size=3).pipeline_batches_in_flight == 3  # default: P
    assert config(pipeline_parallel_size=2, pipeline_batches_in_flight=1).pipeline_batches_in_flight == 1
    assert config().pipeline_batches_in_flight == 1
    with pytest.raises(ConfigError, match="1 to pipeline_parallel_size"):
        config(pipeline_parallel_size=2, pipeline_batches_in_flight=3)
    with pytest.raises(ConfigError, match="needs pipeline parallelism"):
        config(pipeline_batches_in_flight=2)


# many requests at once, prompts longer than a step's 48 tokens (chunked), some stopped by a token
OPTS = dict(max_model_len=128, max_num_batched_tokens=48, enable_prefix_caching=True, enable_chunked_prefill=True)


def _prompts() -> list[dict]:
    rng = random.Random(11)
    return [{"prompt_token_ids": [1] + [rng.randrange(3, 500) for _ in range(n)]}
            for n in (5, 60, 12, 33, 7, 90, 21, 3, 41, 15, 70, 9)]  # fmt: skip


def _params(stops: dict[int, int] | None = None) -> list[SamplingParams]:
    stops = stops or {}
    return [SamplingParams(max_tokens=4 + i % 5, temperature=0.0, stop_token_ids=[stops[i]] if i in stops else None)
            for i in range(len(_prompts()))]  # fmt: skip


def _tokens(llm: LLM, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(_prompts(), params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(three_layers):
    """The single process's greedy tokens, plain and with stop tokens taken from its own output."""
    with LLM(three_layers, **OPTS) as llm:
        plain = _tokens(llm, _params())
        stops = {i: plain[i][1] for i in (1, 4, 6)}  # each stops at its second token (or earlier)
        stopped = _tokens(llm, _params(stops))
    assert all(len(stopped[i]) <= 2 for i in stops) and stopped[0] == plain[0]
    return plain, stops, stopped


@pytest.mark.integration
@pytest.mark.parametrize("tp", [1, 2])
def test_batches_in_flight_equal_one_process(three_layers, reference, tp):
    _, stops, stopped = reference
    with LLM(three_layers, pipeline_parallel_size=2, tensor_parallel_size=tp, **OPTS) as llm:
        assert _tokens(llm, _params(stops)) == stopped  # (the requests without a stop token: plain's)
        counts = llm.core.batch_counts
        assert counts.peak == 2 and counts.overlapped >= counts.launched // 2  # batches really overlapped
        assert llm.stats().num_blocks_used == 0
        busy = llm.core.stage_busy(reset=True)
        assert sorted((b.stage, b.tp_rank) for b in busy) == [(s, t) for s in range(2) for t in range(tp)]
        assert all(0.0 < b.fraction <= 1.0 for b in busy)


@pytest.mark.integration
def test_one_batch_in_flight_and_aborts_mid_flight(three_layers, reference):
    plain, _, _ = reference
    with LLM(three_layers, pipeline_parallel_size=2, pipeline_batches_in_flight=1, **OPTS) as llm:
        assert _tokens(llm, _params()) == plain
        assert llm.core.batch_counts.launched == 0  # (the batch queue is off: one step at a time)
    with LLM(three_layers, pipeline_parallel_size=2, **OPTS) as llm:
        core, params, eos = llm.core, _params(), llm.input_processor.eos_token_ids
        for i, prompt in enumerate(_prompts()):
            core.add_request(EngineCoreRequest(f"q{i}", prompt["prompt_token_ids"], params[i], params[i].max_tokens,
                                               eos))  # fmt: skip
        pipeline, tokens, aborted = step_pipeline(core), {}, set()
        while core.has_unfinished() or pipeline.busy:
            pipeline.launch()
            if len(pipeline.queue) == 2 and not aborted:  # one request of each batch in flight, one waiting
                aborted = {pipeline.queue[0][0].scheduled[0].request.request_id,
                           pipeline.queue[1][0].scheduled[-1].request.request_id, core.scheduler.waiting[-1].request_id}  # fmt: skip
                assert set(core.abort_requests(sorted(aborted))) == aborted
            done = pipeline.finish()
            for out in done.outputs if done is not None else []:
                assert out.request_id not in aborted  # nothing of an aborted request goes out after the abort
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert len(aborted) == 3 and core.kv.pool.num_used == 0 and not core.scheduler.in_flight
        for i, want in enumerate(plain):
            if f"q{i}" not in aborted:  # (the engine's own tokens may end with the EOS the output leaves out)
                got = tokens[f"q{i}"]
                assert got[: len(want)] == want and len(got) - len(want) in (0, 1)
        assert _tokens(llm, _params()) == plain  # and the engine goes on as before
