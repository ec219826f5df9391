"""Sleep and wake costs by model size on one GPU (issue 21), and that waking changes no token.

For each Llama shape (dummy weights): start an engine with a fixed KV cache, generate greedily,
then sleep at level 1 and wake, sleep at level 2 and wake, timing each and reading the device
memory in use; the tokens after each wake must equal the tokens before. Writes one JSON line
per shape to $OUT/wake_costs.jsonl as soon as it is measured (a timeout keeps what finished).

    python3 scripts/gpu/wake_costs.py 8b 8b-vmm 1b-vmm 14b-vmm

The last level-1 sleep and wake (the second) overwrite the first's keys: the steady state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

SHAPES = {  # name: (hidden, intermediate, layers, heads, kv heads, vocab)
    "1b": (2048, 8192, 16, 32, 8, 128256),
    "3b": (3072, 8192, 28, 24, 8, 128256),
    "8b": (4096, 14336, 32, 32, 8, 128256),
    "14b": (5120, 13824, 48, 40, 8, 152064),
    "toy": (64, 128, 2, 4, 2, 1000),  # a check of this script on a CPU
}
KV_BYTES = 4 << 30
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11], list(range(100, 164)), [42] * 20]


def model_dir(shape: str) -> str:
    hidden, inter, layers, heads, kv, vocab = SHAPES[shape]
    path = f"/tmp/llama{shape}"
    subprocess.run([sys.executable, "-m", "llmserve", "make-random-model", path, "--config-only",
                    "--vocab-size", str(vocab), "--hidden-size", str(hidden), "--intermediate-size", str(inter),
                    "--num-layers", str(layers), "--num-heads", str(heads), "--num-kv-heads", str(kv)],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    return path


def used_gib() -> float | None:
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / 2**30, 2)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def tokens(llm, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def measure(label: str) -> dict:
    from llmserve import LLM, SamplingParams

    shape, _, variant = label.partition("-")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    start = time.perf_counter()
    # "vmm": sleep mode's arenas (fixed addresses: the CUDA graphs stay through a sleep)
    llm = LLM(model=model_dir(shape), load_format="dummy", max_model_len=2048, kv_cache_memory_bytes=KV_BYTES,
              enforce_eager=variant == "eager", enable_sleep_mode=variant == "vmm")  # fmt: skip
    row = {"model": label, "startup_s": round(time.perf_counter() - start, 2), "used_gib_awake": used_gib()}
    weights = sum(p.numel() * p.element_size() for p in llm.core.runner.model.parameters())
    row["weight_gib"] = round(weights / 2**30, 2)
    before = tokens(llm, params)
    graphs = llm.core.runner.graphs
    for level in (1, 2, 1):
        t0 = time.perf_counter()
        llm.sleep(level)
        sync()
        row[f"sleep{level}_s"] = round(time.perf_counter() - t0, 3)
        row[f"used_gib_asleep{level}"] = used_gib()
        t0 = time.perf_counter()
        llm.wake_up()
        sync()
        row[f"wake{level}_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        after = tokens(llm, params)
        row[f"first_generate_after_wake{level}_s"] = round(time.perf_counter() - t0, 3)
        row[f"tokens_equal_after_wake{level}"] = after == before
        row[f"graphs_kept_wake{level}"] = graphs is not None and llm.core.runner.graphs is graphs
    row["pcie_gb_per_s_level1"] = round(weights / row["wake1_s"] / 1e9, 1)
    row["sleep_mode_arenas"] = llm.core.runner.sleep_mode.weights_arena is not None
    llm.shutdown()
    del llm
    import gc

    gc.collect()  # an engine's arenas go back with it
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main() -> None:
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    for label in sys.argv[1:] or ["8b", "8b-eager", "1b", "3b"]:
        row = measure(label)
        print("RESULT", json.dumps(row), flush=True)
        with open(os.path.join(out, "wake_costs.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
