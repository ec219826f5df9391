"""The batched sampler's host time a step at 512 rows, by sampling kind, on this CPU: a vocabulary
of 64, so the tensor work is small and what is timed is mostly the host's (the Python over the
batch's requests, the small copies, the op launches). Best of 5 means of 20 steps, one thread.

    python3 scripts/sampler_host_probe_cpu.py            # this tree
    PYTHONPATH=.ab/main python3 scripts/sampler_host_probe_cpu.py   # another tree (ab_trees.sh prepare)
"""

from __future__ import annotations

import json
import time

import torch

from llmserve.engine.request import EngineCoreRequest, Request
from llmserve.engine.sampler import Sampler
from llmserve.sampling_params import SamplingParams

KINDS = {"greedy": dict(temperature=0), "t0.8": dict(temperature=0.8),
         "presence": dict(temperature=0.8, presence_penalty=0.5), "repetition": dict(temperature=0, repetition_penalty=1.1),
         "topk50_topp": dict(temperature=0.8, top_p=0.95, top_k=50), "seeded_t0.8": dict(temperature=0.8, seed=1)}  # fmt: skip


def main() -> None:
    torch.set_num_threads(1)
    logits = torch.randn(512, 64)
    out = {}
    for name, kw in KINDS.items():
        reqs = [Request(EngineCoreRequest(f"r{i}", list(range(50)), SamplingParams(max_tokens=256, **kw), 256, (2,)))
                for i in range(512)]  # fmt: skip
        sampler = Sampler(torch.device("cpu"))
        for _ in range(3):
            sampler.sample_async(logits, reqs)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(20):
                sampler.sample_async(logits, reqs)
            best = min(best, (time.perf_counter() - start) / 20)
        out[name] = round(best * 1000, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
