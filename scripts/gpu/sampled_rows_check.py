"""The last layer on the sampling rows alone, on the GPU (run on the device machine).

1. The model's forward with `SampledRows` against its plain forward's sampling rows, on mixed
   batches that take every attention path of the Triton backend (decodes, a fresh prompt for
   SDPA, one for the fresh-prompt kernel, a later chunk, a short prompt, a chunk that does not
   sample), in float32 and bfloat16 on a random model of the 8B's width: the largest difference
   of the hidden rows, and of every layer's KV cache (which must be equal).
2. The engine's greedy tokens with the path and with it turned off (`samples_only` -> False),
   bfloat16, prompts of 600 to 3,000 tokens in chunks of 1,536: the fraction of equal tokens.
Prints RESULT lines and writes $OUT/sampled_rows_check.json.

    python3 scripts/gpu/sampled_rows_check.py
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
from llmserve.engine.input_builder import RowInput  # noqa: E402
from llmserve.model.random_model import make_random_model  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (cpu: a check of this script, a small shape)
SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
             num_key_value_heads=8, max_position_embeddings=8192)  # fmt: skip
# (first new position, new tokens, samples): decodes, a fresh prompt for SDPA (2,048+), one for the
# fresh kernel (512-2,047), a chunk after 3,000 cached tokens, a short prompt, a chunk stopping short
ROWS = ((700, 1, True), (0, 2304, True), (0, 900, True), (3000, 1200, True), (0, 37, True), (1500, 600, False),
        (4000, 1, True))  # fmt: skip
if DEVICE == "cpu":
    SHAPE.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def release() -> None:
    """The engine just dropped gives its device memory back before the next one sizes its cache."""
    import gc

    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def forward_pair(path: str, dtype: str) -> dict:
    # a cache of a set size (1,024 blocks): the check holds three copies of it
    llm = LLM(path, device=DEVICE, dtype=dtype, max_model_len=8192, block_size=16, num_gpu_blocks_override=1024,
              load_format="dummy", enforce_eager=True)  # fmt: skip
    runner = llm.core.runner
    rng = random.Random(7)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for cache in runner.kv_caches:  # the cached prefixes' and decodes' context
        cache.copy_((torch.randn(cache.shape, device=DEVICE, generator=gen) * 0.5).to(cache.dtype))
    saved = [c.clone() for c in runner.kv_caches]
    items, next_block = [], 1
    for start, count, samples in ROWS:
        end = start + count
        table = list(range(next_block, next_block + -(-end // 16)))
        next_block += len(table)
        items.append(RowInput(f"r{len(items)}", table, start, count, [rng.randrange(3, 500) for _ in range(end)], samples))
    batch = runner.inputs.build(items)
    with torch.inference_mode():
        input_ids, positions, meta = batch.to_device(runner.device)
        want = runner.model(input_ids, positions, meta)[batch.logits_indices].float()
        want_caches = [c.clone() for c in runner.kv_caches]
        for cache, old in zip(runner.kv_caches, saved):
            cache.copy_(old)
        got = runner.model(input_ids, positions, meta, batch.sampled_rows(meta, runner.device)).float()
    cache_diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(runner.kv_caches, want_caches))
    result = {"dtype": dtype, "rows": len(batch.logits_indices), "tokens": len(batch.input_ids),
              "hidden_max_abs_diff": float((got - want).abs().max()), "hidden_max_abs": float(want.abs().max()),
              "cache_max_abs_diff": cache_diff}  # fmt: skip
    del llm, runner
    release()
    return result


def engine_tokens(path: str) -> dict:
    rng = random.Random(11)
    prompts = [[1] + [rng.randrange(3, 500) for _ in range(n)] for n in (600, 1800, 3000, 2400, 64, 1100)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(path, device=DEVICE, dtype="bfloat16", max_model_len=8192, num_gpu_blocks_override=4096,
              load_format="dummy", max_num_batched_tokens=1536, seed=3)  # fmt: skip
    runner, taken = llm.core.runner, []
    samples_only = runner.samples_only
    runner.samples_only = lambda batch: taken.append(samples_only(batch)) or taken[-1]
    with_path = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    runner.samples_only = lambda batch: False
    without = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    equal = sum(a == b for x, y in zip(with_path, without) for a, b in zip(x, y))
    first = sum(x[0] == y[0] for x, y in zip(with_path, without))
    del llm
    release()
    return {"tokens_equal": equal, "tokens": sum(map(len, with_path)), "first_tokens_equal": first,
            "prompts": len(prompts), "steps_on_the_path": sum(taken), "steps": len(taken)}  # fmt: skip


def main() -> None:
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_random_model(Path(tmp) / "m", "llama", vocab_size=32000, config_only=True, **SHAPE))
        result = {"forward": [forward_pair(path, dtype) for dtype in ("float32", "bfloat16")],
                  "engine_bf16": engine_tokens(path)}  # fmt: skip
    result["seconds"] = round(time.time() - start, 1)
    (OUT / "sampled_rows_check.json").write_text(json.dumps(result, indent=2))
    for row in result["forward"]:
        print("RESULT forward", json.dumps(row), flush=True)
    print("RESULT engine", json.dumps(result["engine_bf16"]), f"({result['seconds']} s)", flush=True)


if __name__ == "__main__":
    main()
