"""The GPU FP8 path against the CPU FP8 reference (issue 19), run on the device machine.

Models: the shipped tiny model (assets/tiny_model) and small float32 random Llama and Qwen3
models. Each runs with `--quantization fp8` (and then with an FP8 KV cache as well) twice:
on the CPU with the PyTorch reference ops, and on the GPU with the fused kernels, Triton
attention and CUDA graphs (fused norm/SiLU quantization, the split-K GEMM at decode,
`_scaled_mm` for prefill). Greedy tokens are compared position by position up to the first
difference. Where they differ, the CPU reference's own top-2 logit margin at that position
says whether the reference was near a tie (then float32 rounding order decides the token).
Writes $OUT/fp8_vs_reference.json.

    python3 scripts/gpu/fp8_vs_reference.py
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

import torch  # noqa: E402

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.config import TINY_MODEL_DIR  # noqa: E402
from llmserve.model.random_model import make_random_model  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
NEW_TOKENS = 32


def prompts(vocab: int, lengths=(3, 9, 17, 40, 90, 150, 7, 25)) -> list[list[int]]:
    rng = random.Random(0)
    return [[1] + [rng.randrange(3, vocab) for _ in range(n - 1)] for n in lengths]


def greedy(path: str, batch: list[list[int]], device: str, **kw) -> tuple[list[list[int]], list[list[float]]]:
    llm = LLM(path, device=device, dtype="float32", quantization="fp8", max_model_len=256,
              gpu_memory_utilization=0.2, **kw)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    margins = []
    for o in outs:  # top-1 minus top-2 log-probability at each position
        lp = o.outputs[0].logprobs or []
        margins.append([abs(sorted((v.logprob for v in d.values()), reverse=True)[0] -
                            sorted((v.logprob for v in d.values()), reverse=True)[1]) if len(d) > 1 else 99.0
                        for d in lp])  # fmt: skip
    llm.shutdown()
    del llm
    torch.cuda.empty_cache()
    return tokens, margins


def compare(name: str, path: str, vocab: int, **kw) -> dict:
    started = time.perf_counter()
    batch = prompts(vocab)
    cpu, margins = greedy(path, batch, "cpu", attention_backend="reference", **kw)
    gpu, _ = greedy(path, batch, "cuda", attention_backend="triton", **kw)
    same = total = 0
    firsts = []
    for want, got, margin in zip(cpu, gpu, margins):
        n = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), len(want))
        same += n
        total += len(want)
        if n < len(want):
            firsts.append({"position": n, "reference_top2_margin": round(margin[n], 5) if n < len(margin) else None})
    row = {"model": name, **kw, "sequences": len(batch), "equal_sequences": len(batch) - len(firsts),
           "positions_equal_before_first_difference": f"{same} of {total}", "first_differences": firsts, "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
    print("RESULT", json.dumps(row), flush=True)
    return row


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {"tiny (assets/tiny_model)": (str(TINY_MODEL_DIR), None)}
        for i, family in enumerate(("llama", "qwen3")):
            path = make_random_model(Path(tmp) / family, family, seed=i, hidden_size=256, intermediate_size=512,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=64)  # fmt: skip
            models[f"random {family} 256/512"] = (str(path), 500)
        for name, (path, vocab) in models.items():
            vocab = vocab or json.loads(Path(path, "config.json").read_text())["vocab_size"]
            # the GEMMs of every step with fast accumulation as well (by default only steps of 1,024+ tokens,
            # which these prompts never reach); a CPU ignores it
            for kw in ({}, {"kv_cache_dtype": "fp8"}, {"fp8_fast_accum_tokens": 1}):
                try:
                    rows.append(compare(name, path, vocab, **kw))
                except Exception as exc:  # noqa: BLE001 - one failing model is a finding, not the end
                    rows.append({"model": name, **kw, "error": f"{type(exc).__name__}: {exc}"[:400]})
                    print("RESULT", json.dumps(rows[-1]), flush=True)
                OUT.mkdir(parents=True, exist_ok=True)  # after every row: a time limit keeps what ran
                (OUT / "fp8_vs_reference.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
