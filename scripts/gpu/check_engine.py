"""GPU correctness of the whole engine (run on the device machine).

1. Small float32 random models of every architecture: greedy tokens from the GPU path
   (Triton attention + CUDA graphs: whole graphs for decode steps, piecewise graphs for
   steps with prefill tokens, or those eager) must equal the PyTorch reference path and
   transformers' generate().
2. bf16: a ~1B-shaped random model; the fraction of generated positions where the
   engine's token equals transformers' bf16 argmax under teacher forcing.
Writes $OUT/check_engine.json and prints a table.
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
from llmserve.model.random_model import make_random_model  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
FAMILY_OVERRIDES = {
    "llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": {},
    "qwen2": dict(tie_word_embeddings=True, rope_theta=1e6),
    "qwen3": {},
}  # fmt: skip


def prompts(seed: int, vocab: int, lengths=(5, 19, 41, 70, 130)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab) for _ in range(n - 1)] for n in lengths]


def hf_greedy(path: str, batch: list[list[int]], max_new: int, dtype=torch.float32) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    outs = []
    with torch.no_grad():
        for ids in batch:
            gen = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=max_new, do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(ids):].tolist())
    del model
    torch.cuda.empty_cache()
    return outs


def engine_greedy(path: str, batch: list[list[int]], max_new: int, **kw) -> list[list[int]]:
    llm = LLM(path, device="cuda", max_model_len=256, gpu_memory_utilization=0.3, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], SamplingParams(temperature=0, max_tokens=max_new), use_tqdm=False)
    del llm
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs]


def check_float32(tmp: Path) -> list[dict]:
    rows = []
    for i, (family, over) in enumerate(FAMILY_OVERRIDES.items()):
        path = str(make_random_model(tmp / family, family, seed=i, hidden_size=128, intermediate_size=256,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, **over))
        batch = prompts(i, 500)
        ref_hf = hf_greedy(path, batch, 32)
        variants = {
            "reference-eager": dict(dtype="float32", attention_backend="reference", enforce_eager=True),
            "triton-eager": dict(dtype="float32", attention_backend="triton", enforce_eager=True),
            "triton-graphs": dict(dtype="float32", attention_backend="triton"),
            "triton-graphs-chunked16": dict(dtype="float32", attention_backend="triton", max_num_batched_tokens=16),
            "triton-graphs-no-piecewise": dict(dtype="float32", attention_backend="triton", max_mixed_graph_tokens=0),
        }
        for name, kw in variants.items():
            try:
                got = engine_greedy(path, batch, 32, **kw)
                rows.append({"family": family, "variant": name, "equal_to_hf": got == ref_hf,
                             "seqs_equal": sum(a == b for a, b in zip(got, ref_hf)), "seqs": len(batch)})
            except Exception as exc:  # noqa: BLE001 - report and go on
                rows.append({"family": family, "variant": name, "error": repr(exc)[:300]})
            print("RESULT", json.dumps(rows[-1]), flush=True)
    return rows


def check_bf16(tmp: Path) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp / "llama-1b"
    make_random_model(path, "llama", config_only=True, vocab_size=32000)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                      rope_theta=500000.0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(path)
    batch = prompts(7, 32000, lengths=[16 + 8 * i for i in range(32)])
    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.5)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    agree = total = 0
    model.eval()
    with torch.no_grad():
        for p, o in zip(batch, outs):
            seq = torch.tensor([p + o.outputs[0].token_ids], device="cuda")
            logits = model(seq).logits[0, len(p) - 1 : -1]
            hf_tokens = logits.argmax(-1).tolist()
            agree += sum(a == b for a, b in zip(hf_tokens, o.outputs[0].token_ids))
            total += len(hf_tokens)
    del llm
    return {"bf16_positions": total, "bf16_agree": agree, "bf16_agree_frac": agree / total}


def main() -> None:
    start = time.time()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rows = check_float32(tmp)
        bf16 = check_bf16(tmp)
        print("RESULT", json.dumps(bf16), flush=True)
    result = {"float32": rows, "bf16": bf16, "seconds": time.time() - start}
    (OUT / "check_engine.json").write_text(json.dumps(result, indent=2))
    for r in rows:
        print(f"{r['family']:8s} {r['variant']:24s} " + (f"equal_to_hf={r['equal_to_hf']} ({r['seqs_equal']}/{r['seqs']})" if "error" not in r else "ERROR " + r["error"]))
    print(f"bf16 teacher-forced agreement with transformers: {bf16['bf16_agree']}/{bf16['bf16_positions']} = {bf16['bf16_agree_frac']:.4f}")
    print(f"check_engine took {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
