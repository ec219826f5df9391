"""GPU correctness of tensor parallelism (run on a machine with 2 GPUs).

A small float32 random Llama: greedy tokens with TP=2 (NCCL, Triton kernels, CUDA graphs
and eager) against TP=1 eager on one GPU, with the logprob differences that tell rounding
from a defect. Writes $OUT/check_tp.json and prints a table.
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


Sample = tuple[list[int], list[dict]]  # greedy tokens, and per position token -> logprob (top 2)


def greedy(path: str, prompts: list[list[int]], **kw) -> tuple[list[Sample], float]:
    start = time.perf_counter()
    print(f"--- engine {kw}", flush=True)
    with LLM(path, device="cuda", dtype="float32", max_model_len=512, gpu_memory_utilization=0.3, **kw) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0, max_tokens=48, logprobs=2), use_tqdm=False,
        )
    samples = [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
               for o in outs]  # fmt: skip
    return samples, time.perf_counter() - start


def compare(ref: list[Sample], got: list[Sample]) -> dict:
    """Equal positions; where a sequence first differs, the reference's margin between its
    top two tokens there (a tiny margin means a near-tie that rounding can flip); and the
    largest logprob difference of the chosen token over the positions both runs share."""
    same = total = 0
    max_dlogprob, splits = 0.0, []
    for (rt, rl), (gt, gl) in zip(ref, got):
        total += len(rt)
        for j, (a, b) in enumerate(zip(rt, gt)):
            if a != b:
                top = sorted(rl[j].values(), reverse=True)
                splits.append({"at": j, "ref_margin": round(top[0] - top[1], 6) if len(top) > 1 else None})
                break
            same += 1
            max_dlogprob = max(max_dlogprob, abs(rl[j][a] - gl[j][b]))
    return {"equal_positions": same, "positions": total, "all_equal": same == total,
            "max_dlogprob_shared": float(f"{max_dlogprob:.3g}"), "first_splits": splits}


def main() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if os.environ.get("TP_HANG_DUMP_S"):  # diagnose a hang: print every thread's stack, then exit
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["TP_HANG_DUMP_S"]), exit=True)
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 2000) for _ in range(n)] for n in (5, 19, 41, 70, 130, 250)]
    results = {}
    variants = {  # TP=2 twice after graphs: a second engine in one process needs a clean teardown
        "tp1 graphs": {},
        "tp2 eager": {"tensor_parallel_size": 2, "enforce_eager": True},
        "tp2 graphs": {"tensor_parallel_size": 2},
        "tp2 eager again": {"tensor_parallel_size": 2, "enforce_eager": True},
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_random_model(
            Path(tmp) / "m", "llama", seed=1, vocab_size=2001, hidden_size=512, intermediate_size=1024,
            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        ))  # fmt: skip
        ref, t = greedy(path, prompts, enforce_eager=True)
        results["tp1 eager (reference)"] = {"seconds": round(t, 1)}
        for name, kw in variants.items():
            try:
                got, t = greedy(path, prompts, **kw)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                results[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                continue
            results[name] = {**compare(ref, got), "seconds": round(t, 1)}
            print(f"RESULT {name}: {results[name]}", flush=True)
    (OUT / "check_tp.json").write_text(json.dumps(results, indent=1))
    for name, r in results.items():
        print(f"RESULT {name}: {r}")


if __name__ == "__main__":
    main()
