"""Scheduler and KV-block accounting on CPU with hand-made model outputs: fast and exact."""

from __future__ import annotations

import pytest

from llmserve.config import SchedulerConfig
from llmserve.engine.block_pool import BlockKey
from llmserve.engine.kv_cache_manager import KVCacheManager
from llmserve.engine.request import EngineCoreRequest, Request, RequestStatus
from llmserve.engine.scheduler import Scheduler
from llmserve.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

BS = 4


def make_scheduler(num_blocks=64, budget=64, max_seqs=8, chunked=True, caching=True, cpu_blocks=0, reserve=256):
    kv = KVCacheManager(num_blocks, BS, caching, cpu_blocks)
    cfg = SchedulerConfig(
        max_seqs, budget, chunked, max_model_len=min(256, num_blocks * BS), admission_reserve_tokens=reserve
    )
    return Scheduler(cfg, kv, swap_enabled=cpu_blocks > 0)


def make_request(rid, prompt_len=6, max_tokens=4, priority=0, arrival=0.0, tokens=None, **params):
    ids = tokens if tokens is not None else [10 + (hash(rid) + i) % 50 for i in range(prompt_len)]
    return Request(
        EngineCoreRequest(
            request_id=rid, prompt_token_ids=ids, sampling_params=SamplingParams(**params),
            max_tokens=max_tokens, eos_token_ids=(2,), priority=priority, arrival_time=arrival,
        )
    )  # fmt: skip


def step(sched, token=7):
    out = sched.schedule()
    sampled = {s.request.request_id: token for s in out.scheduled if s.samples}
    sched.after_launch(out)
    return out, sched.update_from_output(out, sampled, {})


def run_to_end(sched, limit=500):
    finished = {}
    for _ in range(limit):
        if not sched.has_unfinished():
            return finished
        _, outs = step(sched)
        for o in outs:
            if o.finish_reason:
                finished[o.request_id] = o.finish_reason
    raise AssertionError("scheduler did not finish")


def test_prefill_then_decode_and_blocks_freed():
    sched = make_scheduler()
    sched.add_request(make_request("a", prompt_len=6, max_tokens=3))
    out, outs = step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 6)]
    assert outs[0].new_token_ids == [7]
    out, _ = step(sched)
    assert out.scheduled[0].num_new_tokens == 1  # decode
    assert run_to_end(sched) == {"a": "length"}
    assert sched.kv.pool.num_used == 0


def test_token_budget_and_chunked_prefill():
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("a", prompt_len=20))
    counts = []
    for _ in range(3):
        out, outs = step(sched)
        counts.append(out.scheduled[0].num_new_tokens)
    assert counts == [8, 8, 4]  # chunks, then the last chunk samples
    assert sched.requests["a"].num_output_tokens == 1


def test_decodes_mixed_with_prefill_chunks():
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("a", prompt_len=4, max_tokens=10))
    step(sched)
    sched.add_request(make_request("b", prompt_len=20, arrival=1.0))
    out, _ = step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]


def test_no_chunking_waits_for_whole_prompt_budget():
    sched = make_scheduler(budget=256, chunked=False)
    sched.add_request(make_request("a", prompt_len=100))
    out, _ = step(sched)
    assert out.scheduled[0].num_new_tokens == 100


def test_max_num_seqs():
    sched = make_scheduler(max_seqs=2)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", arrival=i))
    out, _ = step(sched)
    assert len(out.scheduled) == 2 and len(sched.waiting) == 2


def test_priority_lower_number_first():
    sched = make_scheduler(max_seqs=1)
    sched.add_request(make_request("late-important", priority=-1, arrival=5.0))
    sched.add_request(make_request("early", priority=0, arrival=1.0))
    sched.add_request(make_request("early-important", priority=-1, arrival=2.0))
    order = []
    for _ in range(30):
        if not sched.has_unfinished():
            break
        out, _ = step(sched)
        for s in out.scheduled:
            if s.request.request_id not in order:
                order.append(s.request.request_id)
    assert order == ["early-important", "late-important", "early"]


def test_recompute_preemption_picks_lowest_priority_latest():
    # 6 blocks of 4 tokens; three 8-token prompts take 2 blocks each; decode needs more (admitted
    # without reserving the decodes' growth, as before admission_reserve_tokens)
    sched = make_scheduler(num_blocks=6, budget=64, reserve=0)
    sched.watermark = 0
    sched.add_request(make_request("a", prompt_len=8, max_tokens=6, arrival=0))
    sched.add_request(make_request("b", prompt_len=8, max_tokens=6, arrival=1, priority=-1))
    sched.add_request(make_request("c", prompt_len=8, max_tokens=6, arrival=2))
    step(sched)
    assert sched.kv.pool.num_free == 0
    out, _ = step(sched)  # decodes need a third block each: someone must go
    preempted = sched.waiting[0]
    assert preempted.request_id == "c" and preempted.status == RequestStatus.PREEMPTED
    assert preempted.num_computed_tokens == 0 and sched.num_preemptions >= 1
    finished = run_to_end(sched)
    assert finished == {"a": "length", "b": "length", "c": "length"}
    assert sched.kv.pool.num_used == 0


@pytest.mark.parametrize("reserve", [0, 2, 6])
def test_admission_keeps_the_running_requests_growth_free(reserve):
    """The scene above with the requests' growth reserved at admission (the running ones' and the
    newcomer's own): fewer at once, and with the whole growth reserved (6 tokens: max_tokens) no
    preemption. 2 tokens of horizon reserve one block a request: one more is admitted, and the
    decodes past that block still preempt."""
    sched = make_scheduler(num_blocks=6, budget=64, reserve=reserve)
    sched.watermark = 0
    for i, rid in enumerate("abc"):
        sched.add_request(make_request(rid, prompt_len=8, max_tokens=6, arrival=i))
    out, _ = step(sched)
    admitted = [s.request.request_id for s in out.scheduled]
    # 8 prompt + 6 output tokens = 4 blocks a request: with the whole growth kept free only "a" fits
    # at first; with 2 tokens of it (one block each) "a" and "b"; with none all three
    assert admitted == {0: ["a", "b", "c"], 2: ["a", "b"], 6: ["a"]}[reserve]
    assert run_to_end(sched) == {"a": "length", "b": "length", "c": "length"}
    assert (sched.num_preemptions == 0) == (reserve == 6)
    assert sched.kv.pool.num_used == 0


def test_admission_reserves_the_rest_of_a_chunked_prompt():
    """A prompt admitted in chunks keeps the blocks for its later chunks: a second request is not
    admitted into them (it would be preempted, or preempt, when the first prompt's next chunk comes)."""
    sched = make_scheduler(num_blocks=8, budget=8, reserve=1)
    sched.watermark = 0
    sched.add_request(make_request("long", prompt_len=24, max_tokens=1, arrival=0))
    sched.add_request(make_request("short", prompt_len=4, max_tokens=1, arrival=1))
    out, _ = step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("long", 8)]
    assert sched._growth_blocks(sched.running[0]) == 5  # 16 prompt tokens and 1 output token: 17 -> 5 blocks
    assert run_to_end(sched) == {"long": "length", "short": "length"} and sched.num_preemptions == 0


def test_swap_preemption_keeps_progress():
    sched = make_scheduler(num_blocks=6, budget=64, cpu_blocks=16, reserve=0)
    sched.watermark = 0
    for i, rid in enumerate("abc"):
        sched.add_request(make_request(rid, prompt_len=8, max_tokens=6, arrival=i))
    step(sched)
    out, _ = step(sched)
    assert out.blocks_to_swap_out, "the victim's blocks go to CPU"
    victim = sched.waiting[0]
    assert victim.status == RequestStatus.SWAPPED and victim.num_computed_tokens == 8  # its prompt stays computed
    swapped_in = False
    for _ in range(100):
        if not sched.has_unfinished():
            break
        out, _ = step(sched)
        swapped_in |= bool(out.blocks_to_swap_in)
    assert swapped_in and not sched.has_unfinished()
    assert sched.kv.pool.num_used == 0 and sched.kv.swap_pool.num_free == 16


def test_abort_anywhere_frees_blocks():
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("running", prompt_len=4, max_tokens=50))
    sched.add_request(make_request("chunking", prompt_len=30, arrival=1))
    sched.add_request(make_request("waiting", prompt_len=30, arrival=2))
    step(sched)
    step(sched)
    assert sched.kv.pool.num_used > 0
    assert sched.abort_requests(["running", "chunking", "waiting", "unknown"]) == [
        "running", "chunking", "waiting",
    ]  # fmt: skip
    assert sched.kv.pool.num_used == 0 and not sched.has_unfinished()
    assert sched.schedule().finished_request_ids == ["running", "chunking", "waiting"]


def test_stop_conditions():
    sched = make_scheduler()
    sched.add_request(make_request("eos", max_tokens=10))
    sched.add_request(make_request("ignore", max_tokens=3, ignore_eos=True))
    sched.add_request(make_request("min", max_tokens=10, min_tokens=2))
    sched.add_request(make_request("stopid", max_tokens=10, stop_token_ids=[2]))
    results = {}
    for _ in range(10):
        if not sched.has_unfinished():
            break
        _, outs = step(sched, token=2)
        for o in outs:
            if o.finish_reason:
                results[o.request_id] = (o.finish_reason, o.stop_reason)
    assert results["eos"] == ("stop", None)
    assert results["ignore"] == ("length", None)
    assert results["min"] == ("stop", None)
    assert results["stopid"] == ("stop", None)  # eos wins: it is an EOS id too


def test_duplicate_request_id_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("x"))
    with pytest.raises(ValueError):
        sched.add_request(make_request("x"))


def test_prefix_hit_skips_cached_blocks_and_counts():
    sched = make_scheduler()
    shared = list(range(20, 32))  # 3 full blocks of 4
    sched.add_request(make_request("first", tokens=shared + [40, 41], max_tokens=1))
    run_to_end(sched)
    sched.add_request(make_request("second", tokens=shared + [50, 51, 52], max_tokens=1))
    out, _ = step(sched)
    assert out.scheduled[0].num_new_tokens == 3  # only its own tokens
    assert sched.kv.prefix_hits == 12
    assert sched.kv.prefix_queries == 14 + 15


def test_siblings_wait_for_shared_prompt_blocks():
    sched = make_scheduler(budget=64)
    prompt = list(range(20, 33))  # 13 tokens: 3 full blocks
    for i in range(3):
        req = make_request(f"{i}_g", tokens=prompt, max_tokens=4, arrival=0)
        req.share_group = "g"
        sched.add_request(req)
    out, _ = step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["0_g"]
    out, _ = step(sched)
    new = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert new["1_g"] == 1 and new["2_g"] == 1  # 12 of 13 prompt tokens shared
    shared = sched.kv.block_table("1_g")[:3]
    assert shared == sched.kv.block_table("0_g")[:3] == sched.kv.block_table("2_g")[:3]
    run_to_end(sched)
    assert sched.kv.pool.num_used == 0


def reference_keys(tokens, num_full):
    keys, parent = [], None
    for i in range(num_full):
        keys.append(BlockKey(parent, tuple(tokens[i * BS : (i + 1) * BS]), None))
        parent = hash(keys[-1])
    return keys


def reference_computed_blocks(kv, req):
    """The prefix lookup as it was: every full block's key first, then the hits up to the first miss."""
    keys = reference_keys(req.all_token_ids, (req.num_tokens - 1) // BS)
    hits = []
    for key in keys:
        if kv.pool.lookup(key) is None:
            break
        hits.append(kv.pool.lookup(key))
    return hits


def test_prefix_lookup_makes_keys_up_to_the_first_miss_and_matches_the_reference():
    sched = make_scheduler(num_blocks=256, budget=256)
    shared = list(range(20, 52))  # 8 full blocks of 4
    sched.add_request(make_request("first", tokens=shared + [60, 61], max_tokens=1))
    run_to_end(sched)
    kv = sched.kv
    for rid, tokens, hits in (("fresh", [70 + i for i in range(41)], 0), ("half", shared[:16] + [99] * 25, 4),
                              ("all", shared + [80, 81, 82], 8), ("one_less", shared[:-1] + [5], 7)):  # fmt: skip
        req = make_request(rid, tokens=tokens)
        got = kv.get_computed_blocks(req)
        assert got == reference_computed_blocks(kv, req) and len(got) == hits, rid
        # keys made: the hits and the first miss (none past it), unless every full block hit
        assert len(req.block_hashes) == min(hits + 1, (len(tokens) - 1) // BS), rid
        num_full = (len(tokens) - 1) // BS  # the rest, made when the blocks are offered, chain on
        assert kv._block_keys(req, num_full) == reference_keys(tokens, num_full), rid


def test_a_chunks_full_blocks_are_registered_at_launch_and_found_by_the_next_step():
    sched = make_scheduler(num_blocks=256, budget=24)  # a 41-token prompt in chunks of 24 and 17
    tokens = [70 + i for i in range(41)]
    sched.add_request(make_request("p", tokens=tokens, max_tokens=2))
    kv = sched.kv
    out = sched.schedule()
    req = out.scheduled[0].request
    sched.after_launch(out)
    # the chunk's 6 full blocks are in the cache while the device computes them
    assert req.block_hashes == reference_keys(tokens, 6) and kv.num_cached_blocks(req) == 6
    assert [kv.pool.lookup(k) for k in reference_keys(tokens, 6)] == kv.block_table("p")[:6]
    # a request arriving now is scheduled into the next step (after this one on the device) and
    # reads those 6 blocks from the cache; its own first miss is the 7th
    sched.add_request(make_request("q", tokens=tokens[:24] + [5] * 9, max_tokens=1))
    out2 = sched.schedule()
    q = next(s.request for s in out2.scheduled if s.request.request_id == "q")
    assert q.num_cached_tokens == 24 and kv.block_table("q")[:6] == kv.block_table("p")[:6]
    assert [s.samples for s in out2.scheduled] == [True, False]  # (q's 9 new tokens: 7 fit the budget)
    sched.update_from_output(out, {}, {})  # the first step's result: nothing more to register
    assert kv.num_cached_blocks(req) == 6
    sched.after_launch(out2)  # p's last chunk: 10 full blocks of known tokens (the sampled one is pending)
    assert req.block_hashes == reference_keys(tokens, 10) and kv.num_cached_blocks(req) == 10
    sched.update_from_output(out2, {"p": 9}, {})
    assert kv.num_cached_blocks(req) == 10
    assert [kv.pool.lookup(k) for k in reference_keys(tokens, 10)] == kv.block_table("p")[:10]
    # a decode registers nothing at launch (its block's last token is not known until it is sampled)
    out = sched.schedule()
    sched.after_launch(out)
    assert len(req.block_hashes) == 10 and kv.num_cached_blocks(req) == 10
