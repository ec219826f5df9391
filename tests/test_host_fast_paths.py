"""The host path's fast paths against their references (issue 51): `Scheduler.fast_paths` (calls of
`allocate_slots`, `cache_full_blocks` and `_check_stop` skipped where they would change nothing) and
`OutputProcessor.defer_detok` (a sample's tokens detokenized when its text is read). Random workloads
with EOS, stop tokens, min_tokens, priorities, n > 1 siblings, aborts, preemption (recompute and swap),
sliding windows and steps overlapped as the engine overlaps them: the same steps, outputs and blocks."""

from __future__ import annotations

import random

import pytest

from llmserve.config import SchedulerConfig
from llmserve.engine.kv_cache_manager import KVCacheManager
from llmserve.engine.kv_layout import plan_layout
from llmserve.engine.output_processor import OutputProcessor
from llmserve.engine.request import EngineCoreRequest, Request
from llmserve.engine.scheduler import Scheduler
from llmserve.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

BS = 4
EOS = 2


def make_scheduler(fast: bool, num_blocks: int, swap: bool, sliding: bool) -> Scheduler:
    layout = plan_layout([6, 6, None], [8] * 3) if sliding else None  # (two groups, one slides: Gemma 3's kind)
    kv = KVCacheManager(num_blocks, BS, True, 24 if swap else 0, layout)
    cfg = SchedulerConfig(8, 24, True, max_model_len=64, admission_reserve_tokens=4)
    sched = Scheduler(cfg, kv, swap_enabled=swap)
    sched.fast_paths = fast
    return sched


def random_requests(rng: random.Random, count: int) -> list[tuple[int, Request]]:
    """(arrival step, request): some share a prompt as n > 1 siblings do."""
    made = []
    for i in range(count):
        params = dict(ignore_eos=rng.random() < 0.4, min_tokens=rng.choice([0, 0, 2]))
        if rng.random() < 0.3:
            params["stop_token_ids"] = [rng.randrange(3, 12)]
        group = f"g{i // 2}" if rng.random() < 0.3 else None
        prompt = [3 + (i // 2 if group else i) * 5 % 40 + j for j in range(rng.randrange(1, 14))]
        req = Request(EngineCoreRequest(
            request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=SamplingParams(**params),
            max_tokens=rng.randrange(1, 48), eos_token_ids=(EOS,), priority=rng.choice([0, 0, 1]),
            arrival_time=float(i), share_group=group,
        ))  # fmt: skip
        made.append((rng.randrange(0, 12), req))
    return made


def steps_of(sched: Scheduler, workload: list[tuple[int, Request]], seed: int, overlap: bool) -> list:
    """Every step's plan and outputs, as plain values (no clock readings); the KV state at the end."""
    rng = random.Random(seed)  # the tokens and aborts: the same draws for both schedulers
    record, in_flight = [], []
    for t in range(400):
        for when, req in workload:
            if when == t:
                sched.add_request(req)
        if t % 11 == 3 and sched.requests:
            victim = sorted(sched.requests)[rng.randrange(len(sched.requests))]
            record.append(("abort", sched.abort_requests([victim])))
        out = sched.schedule()
        sched.after_launch(out)
        record.append((
            [(s.request.request_id, s.num_new_tokens, s.samples, list(s.block_table)) for s in out.scheduled],
            list(out.blocks_to_swap_out), list(out.blocks_to_swap_in), list(out.finished_request_ids),
        ))  # fmt: skip
        # a token per sampling row: EOS, a stop token or another, drawn in the row's order
        sampled = {
            s.request.request_id: EOS if rng.random() < 0.04 else rng.randrange(3, 20)
            for s in out.scheduled
            if s.samples
        }
        in_flight.append((out, sampled))
        while len(in_flight) > (1 if overlap and rng.random() < 0.7 and sched.has_unfinished() else 0):
            done, sampled = in_flight.pop(0)  # (overlapped: the next step is scheduled before this one ends)
            outputs = sched.update_from_output(done, sampled, {})
            record.append([(o.request_id, o.new_token_ids, o.finish_reason, o.stop_reason, o.num_cached_tokens)
                           for o in outputs])  # fmt: skip
        if t > 12 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), "the workload did not finish"
    kv = sched.kv
    record.append((kv.pool.num_used, kv.swap_pool.num_free, kv.prefix_queries, kv.prefix_hits,
                   sched.num_preemptions, sched.num_swap_outs, sched.num_computed_tokens_total))  # fmt: skip
    return record


@pytest.mark.parametrize("sliding", [False, True])
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_scheduler_fast_paths_equal_the_calls(seed, swap, sliding):
    count, num_blocks, overlap = workload_case(seed)
    runs = {}
    for fast in (False, True):
        sched = make_scheduler(fast, num_blocks, swap, sliding)
        runs[fast] = steps_of(sched, random_requests(random.Random(seed), count), seed, overlap)
    assert runs[True] == runs[False]


def workload_case(seed: int) -> tuple[int, int, bool]:
    rng = random.Random(seed)
    return rng.randrange(10, 20), rng.randrange(12, 24), seed % 3 != 0  # requests, blocks, overlapped steps


@pytest.mark.parametrize("sliding", [False, True])
@pytest.mark.parametrize("swap", [False, True])
def test_the_workloads_preempt_and_stop(swap, sliding):
    """The random workloads reach the paths under test: preemptions, and both ways to finish."""
    preempting, reasons = 0, set()
    for seed in range(6):
        count, num_blocks, overlap = workload_case(seed)
        record = steps_of(make_scheduler(True, num_blocks, swap, sliding), random_requests(random.Random(seed), count),
                          seed, overlap)  # fmt: skip
        preempting += record[-1][4] > 0
        reasons |= {o[2] for step in record if isinstance(step, list) for o in step if o[2]}
    assert preempting >= 4 and reasons == {"stop", "length"}


def test_engine_outputs_equal_with_and_without_the_fast_paths(llama_dir, monkeypatch):
    """The whole engine on the CPU: texts, tokens, logprobs, finish and stop reasons and the stats,
    with stop strings (the front aborts), n > 1, EOS, preemption (a small cache) and overlapped steps."""
    from llmserve import LLM

    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 200 for j in range(rng.randrange(2, 20))]} for i in range(12)]
    params = []
    for i in range(12):
        p = SamplingParams(temperature=1.0, seed=i, max_tokens=rng.randrange(4, 40), ignore_eos=i % 3 == 0,
                           n=2 if i % 4 == 1 else 1, logprobs=2 if i % 5 == 2 else None, stop=["e", "a"] if i % 4 == 3 else None)  # fmt: skip
        params.append(p)
    results = {}
    for fast in (False, True):
        monkeypatch.setattr(Scheduler, "fast_paths", fast)
        monkeypatch.setattr(OutputProcessor, "defer_detok", fast)
        with LLM(model=llama_dir, device="cpu", dtype="float32", max_num_seqs=8, num_gpu_blocks_override=16,
                 block_size=4, max_model_len=64, admission_reserve_tokens=0) as llm:  # fmt: skip
            outs = llm.generate(prompts, params, use_tqdm=False)
            stats = llm.stats()
        results[fast] = (
            [[(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason, c.cumulative_logprob,
               None if c.logprobs is None else [dict(d) for d in c.logprobs]) for c in o.outputs]
             for o in outs],
            (stats.num_preemptions, stats.prefix_cache_queries, stats.prefix_cache_hits,
             stats.num_computed_tokens_total),
        )  # fmt: skip
    assert results[True] == results[False]
    assert results[False][1][0] > 0, "the cache is small enough to preempt"
    reasons = {c[3] for o in results[False][0] for c in o}
    assert {"stop", "length"} <= reasons


@pytest.mark.parametrize("reference", [False, True])
def test_host_step_bench_measures_either_path(reference):
    """`llmserve bench host-step --reference` runs with the fast paths off, and puts them back."""
    import argparse

    from llmserve.bench.host_step import run

    seen = []
    args = argparse.Namespace(model=None, num_seqs=[4], steps=8, input_len=4, num_blocks=None, repeat=1,
                              profile=None, output_json=None, reference=reference)  # fmt: skip
    [result] = run(args, log=lambda line: seen.append((Scheduler.fast_paths, OutputProcessor.defer_detok)))
    assert result.num_seqs == 4 and result.decode_steps_timed > 0 and result.component_ms["update"] > 0
    assert seen[0] == (not reference, not reference)  # (logged after the size's runs)
    assert Scheduler.fast_paths and OutputProcessor.defer_detok


def test_group_keys_equal_replace():
    """`KVCacheManager._group_key` builds the tuple `_replace` builds: same class, fields, hash."""
    from llmserve.engine.block_pool import BlockKey

    rng = random.Random(0)
    for _ in range(200):
        salt = rng.choice([None, "adapter", ("group", 3)])
        key = BlockKey(rng.choice([None, rng.getrandbits(60)]), tuple(rng.randrange(9) for _ in range(4)), salt)
        for group in range(4):
            fast, ref = KVCacheManager._group_key(key, group), KVCacheManager._group_key_reference(key, group)
            assert type(fast) is type(ref) is BlockKey and fast == ref and hash(fast) == hash(ref)
            assert fast.salt == ref.salt and (group == 0 or fast.salt == (salt, group))
