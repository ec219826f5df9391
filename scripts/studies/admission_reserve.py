"""What reserving the running requests' growth at admission does to a workload that fills the KV
cache (issue 19's (c): 1,000 x 1,024 in / 128 out on the 8B shape's ~900k KV tokens of an H200):
the scheduler alone on the CPU, outputs made up, every `--admission-reserve-tokens` value given.
Prints, per value: steps, preemptions, tokens computed (prompts recomputed after a preemption
count again), mean sequences per decode step, and the scheduler's own time a step.

    python scripts/studies/admission_reserve.py --kv-tokens 900976 --reserve 0,128,256
"""

from __future__ import annotations

import argparse
import time

from llmserve.config import SchedulerConfig
from llmserve.engine.kv_cache_manager import KVCacheManager
from llmserve.engine.request import EngineCoreRequest, Request
from llmserve.engine.scheduler import Scheduler
from llmserve.sampling_params import SamplingParams


def run(opts: argparse.Namespace, reserve: int) -> dict:
    kv = KVCacheManager(opts.kv_tokens // opts.block_size, opts.block_size, True, 0)
    sched = Scheduler(SchedulerConfig(opts.max_num_seqs, opts.max_num_batched_tokens, True, opts.max_model_len,
                                      admission_reserve_tokens=reserve), kv, swap_enabled=False)  # fmt: skip
    for i in range(opts.num_prompts):
        ids = [(i * 7919 + j) % 32000 + 3 for j in range(opts.input_len)]  # distinct prompts: no cache hits
        sched.add_request(Request(EngineCoreRequest(
            request_id=str(i), prompt_token_ids=ids, sampling_params=SamplingParams(ignore_eos=True),
            max_tokens=opts.output_len, eos_token_ids=(2,), arrival_time=0.0)))  # fmt: skip
    steps = decode_steps = decode_seqs = 0
    sched_s = 0.0
    while sched.has_unfinished():
        t0 = time.perf_counter()
        out = sched.schedule()
        sched_s += time.perf_counter() - t0
        steps += 1
        decodes = sum(1 for s in out.scheduled if s.num_new_tokens == 1)
        if decodes:
            decode_steps += 1
            decode_seqs += decodes
        sched.after_launch(out)
        sched.update_from_output(out, {s.request.request_id: 5 for s in out.scheduled if s.samples}, {})
    return {"reserve": reserve, "steps": steps, "preemptions": sched.num_preemptions,
            "tokens_computed": sched.num_computed_tokens_total,
            "mean_decodes_a_step": round(decode_seqs / max(1, decode_steps), 1),
            "scheduler_ms_a_step": round(1000 * sched_s / steps, 3)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-tokens", type=int, default=900976)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--reserve", default="0,64,128,256")
    opts = ap.parse_args()
    for reserve in (int(r) for r in opts.reserve.split(",")):
        print(run(opts, reserve), flush=True)


if __name__ == "__main__":
    main()
