"""Where batch-1 time to first token goes on the 8B shape (PROMPT_LEN tokens, default 512): generate()
with max_tokens=1 timed for greedy and random sampling, then one such call under the torch
profiler (top CUDA kernels, and the host time around them). MIXED=0: the prefill step eager
(no piecewise CUDA graphs)."""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from llmserve import LLM, SamplingParams  # noqa: E402

MODEL = os.environ.get("M", "/tmp/llama8b")
PROMPT_LEN = int(os.environ.get("PROMPT_LEN", 512))


def main() -> None:
    llm = LLM(
        MODEL,
        load_format="dummy",
        max_model_len=int(os.environ.get("MAX_LEN", 2048)),
        max_num_seqs=8,
        max_num_batched_tokens=max(16384, PROMPT_LEN),
        max_mixed_graph_tokens=int(os.environ.get("MIXED", 1024)),
    )
    rng = random.Random(0)

    def once(temperature: float) -> float:
        prompt = [rng.randrange(10, llm.config.model_config.arch.vocab_size) for _ in range(PROMPT_LEN)]
        params = SamplingParams(temperature=temperature, max_tokens=1, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return (time.perf_counter() - t) * 1000

    for temperature in (1.0, 0.0, 1.0):
        for _ in range(2):
            once(temperature)
        times = [once(temperature) for _ in range(5)]
        print(f"RESULT ttft temperature={temperature}: " + " ".join(f"{x:.1f}" for x in times) + " ms", flush=True)
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("ttft_once"):
            once(1.0)
    print_timeline(prof)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))


def print_timeline(prof) -> None:
    """Where the host leaves the GPU idle in one TTFT: host time before the first kernel and
    after the last, the kernels' span and busy time, and the largest gaps between kernels with
    the kernels on either side."""
    from torch.autograd import DeviceType

    events = prof.events()
    whole = next(e for e in events if e.name == "ttft_once").time_range
    kernels = sorted((e for e in events if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    if not kernels:
        return
    busy, gaps, end, before = 0.0, [], kernels[0].time_range.start, kernels[0]
    for e in kernels:
        start, stop = e.time_range.start, e.time_range.end
        if start > end:
            gaps.append((start - end, before.name[:50], e.name[:50]))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, before = stop, e
    first, last = kernels[0].time_range.start, end
    print(
        f"RESULT timeline: host before first kernel {(first - whole.start) / 1e3:.2f} ms, after last "
        f"{(whole.end - last) / 1e3:.2f} ms, kernel span {(last - first) / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms, "
        f"gaps {sum(g for g, _, _ in gaps) / 1e3:.2f} ms in {len(gaps)}",
        flush=True,
    )
    for gap, a, b in sorted(gaps, reverse=True)[:8]:
        print(f"RESULT gap {gap / 1e3:.3f} ms after {a} before {b}", flush=True)


if __name__ == "__main__":
    main()
