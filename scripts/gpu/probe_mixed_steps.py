"""Prefill steps just under and just over --max-mixed-graph-tokens on the 8B shape: k
prompts at once (max_tokens=1) timed end to end, for an engine with piecewise graphs up
to 1024 tokens and one up to 2048 (MIXED_LIST). Prints RESULT lines: median ms of 5."""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from llmserve import LLM, SamplingParams  # noqa: E402

MODEL = os.environ.get("M", "/tmp/llama8b")


def main() -> None:
    for mixed in [int(x) for x in os.environ.get("MIXED_LIST", "1024 2048").split()]:
        llm = LLM(MODEL, load_format="dummy", max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=16384,
                  max_mixed_graph_tokens=mixed, gpu_memory_utilization=0.45)
        rng = random.Random(0)
        vocab = llm.config.model_config.arch.vocab_size

        def once(lens: list[int]) -> float:
            prompts = [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(n)]} for n in lens]
            t = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
            return (time.perf_counter() - t) * 1000

        for lens in ([512], [512, 512], [512, 520], [512, 512, 512], [512] * 4):
            once(lens)
            times = [once(lens) for _ in range(5)]
            print(f"RESULT mixed={mixed} tokens={sum(lens)} prompts={len(lens)}: median {statistics.median(times):.1f} ms "
                  f"({' '.join(f'{x:.1f}' for x in times)})", flush=True)
        llm.shutdown()


if __name__ == "__main__":
    main()
