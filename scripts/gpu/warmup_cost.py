"""What the engine's sampling warm-up costs on a fresh machine, batch by batch:

    TRITON_CACHE_DIR=$(mktemp -d) python3 scripts/gpu/warmup_cost.py

Samples each batch of `model_runner.warm_sampling_batches` (the warm-up's) twice on a fresh
Sampler with its kernels, on 2 rows x 128,256 bf16 logits: the first run compiles what the batch
needs (an empty Triton cache), the second shows what is left. Prints a RESULT line: per batch, its
settings and the first and second run in ms."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from llmserve.engine.model_runner import warm_sampling_batches  # noqa: E402
from llmserve.engine.step_plan import RunnerRequest  # noqa: E402
from llmserve.engine.sampler import Sampler  # noqa: E402

dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")  # ("cpu" with TRITON_INTERPRET=1: a check of the script)
logits = (torch.randn(2, 128256, device=dev) * 3).to(torch.bfloat16)
sampler = Sampler(dev, use_kernels=True)
rows = []
for i, batch in enumerate(warm_sampling_batches()):
    times = []
    for run in range(2):
        requests = [RunnerRequest(f"w-{i}-{run}-{j}", [0], p, (), [0, 0], []) for j, p in enumerate(batch)]
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        sampler.sample_async(logits[: len(requests)], requests).result()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(round((time.perf_counter() - start) * 1000, 2))
        sampler.forget([r.request_id for r in requests])
    names = ("temperature", "top_p", "top_k", "seed", "logprobs", "presence_penalty", "frequency_penalty",
             "repetition_penalty")  # fmt: skip
    settings = [{k: getattr(p, k) for k in names if getattr(p, k) is not None
                 and (k in ("temperature", "seed", "logprobs") or getattr(p, k) not in (0, 1.0, -1))} for p in batch]  # fmt: skip
    rows.append({"batch": settings, "first_ms": times[0], "second_ms": times[1]})
    print(i, settings, times, flush=True)
print("RESULT", json.dumps({"batches": rows, "first_total_ms": round(sum(r["first_ms"] for r in rows), 1)}), flush=True)
