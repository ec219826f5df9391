"""GPU correctness of tensor parallelism (run on a machine with 2 GPUs).

A small float32 random Llama: greedy tokens with TP=2 (NCCL, Triton kernels, CUDA graphs
and eager) against TP=1 on one GPU. Writes $OUT/check_tp.json and prints a table.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.model.random_model import make_random_model  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))


def greedy(path: str, prompts: list[list[int]], **kw) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    print(f"--- engine {kw}", flush=True)
    with LLM(path, device="cuda", max_model_len=512, gpu_memory_utilization=0.3, **kw) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=48), use_tqdm=False
        )
    return [o.outputs[0].token_ids for o in outs], time.perf_counter() - start


def main() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if os.environ.get("TP_HANG_DUMP_S"):  # diagnose a hang: print every thread's stack, then exit
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["TP_HANG_DUMP_S"]), exit=True)
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 2000) for _ in range(n)] for n in (5, 19, 41, 70, 130, 250)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_random_model(
            Path(tmp) / "m", "llama", seed=1, vocab_size=2001, hidden_size=512, intermediate_size=1024,
            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        ))  # fmt: skip
        if os.environ.get("TP_SKIP_TP1"):
            ref, t = [[]] * len(prompts), 0.0
        else:
            ref, t = greedy(path, prompts)
        results["tp1 (graphs)"] = {"seconds": t}
        for name, kw in {
            "tp2 graphs": dict(tensor_parallel_size=2),
            "tp2 eager": dict(tensor_parallel_size=2, enforce_eager=True),
        }.items():
            try:
                toks, t = greedy(path, prompts, **kw)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                results[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                continue
            same = sum(a == b for x, y in zip(ref, toks) for a, b in zip(x, y))
            total = sum(len(x) for x in ref)
            results[name] = {"equal_positions": same, "positions": total, "all_equal": toks == ref, "seconds": t}
    (OUT / "check_tp.json").write_text(json.dumps(results, indent=1))
    for name, r in results.items():
        print(f"RESULT {name}: {r}")


if __name__ == "__main__":
    main()
