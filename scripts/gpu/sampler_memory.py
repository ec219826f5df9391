"""The batched sampler's device memory at full width: max_num_seqs rows of a vocabulary's logits
(bf16, as the model's LM head gives them), each kind of request the engine serves in turn (greedy,
penalties, top-k/top-p, min-p, logprobs, seeds), the peak of torch's allocator above the logits
themselves. kv_sizing.kv_budget keeps 8 x rows x vocabulary x 4 bytes for this work out of the KV
cache; this measures what it takes (issue 52: 4.98 GB of Qwen3-30B-A3B's KV budget on an H100).

    python3 scripts/gpu/sampler_memory.py [ROWS] [VOCAB...]     -> RESULT lines, $OUT/sampler_memory.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from llmserve.engine.request import EngineCoreRequest, Request  # noqa: E402
from llmserve.engine.sampler import Sampler  # noqa: E402
from llmserve.sampling_params import SamplingParams  # noqa: E402

KINDS = {
    "greedy": [dict(temperature=0)],
    "top_p": [dict(temperature=0.8, top_p=0.95)],
    "top_k_top_p_penalties": [dict(temperature=0.8, top_k=50, top_p=0.95, presence_penalty=0.5, repetition_penalty=1.1)],
    "mixed": [dict(temperature=0), dict(temperature=0, repetition_penalty=1.2),
              dict(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.2), dict(temperature=0.8, top_k=50, top_p=0.95),
              dict(temperature=1.0, min_p=0.05), dict(temperature=0.7, top_p=0.9, logprobs=20)],
}  # fmt: skip


def peak_bytes(rows: int, vocab: int, kinds: list[dict]) -> int:
    device = torch.device("cuda")
    reqs = [Request(EngineCoreRequest(f"r{i}", list(range(10 + i % 100, 600 + i % 100)), SamplingParams(
        max_tokens=50, seed=i if kinds[i % len(kinds)].get("temperature") else None, **kinds[i % len(kinds)]), 50, (2,)))
        for i in range(rows)]  # fmt: skip
    sampler = Sampler(device, vocab_size=vocab, use_kernels=True)
    logits = torch.randn(rows, vocab, device=device).to(torch.bfloat16)
    sampler(logits, reqs)  # first call: compiles and caches what it keeps
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    sampler(logits, reqs)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    vocabs = [int(v) for v in sys.argv[2:]] or [128256, 151936]
    results = []
    for vocab in vocabs:
        reserve = 8 * rows * vocab * 4
        for name, kinds in KINDS.items():
            peak = peak_bytes(rows, vocab, kinds)
            row = dict(rows=rows, vocab=vocab, kind=name, peak_gb=round(peak / 1e9, 3), reserve_gb=round(reserve / 1e9, 3),
                       copies_fp32=round(peak / (rows * vocab * 4), 2))  # fmt: skip
            results.append(row)
            print("RESULT", json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    Path(os.environ.get("OUT", "."), "sampler_memory.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
