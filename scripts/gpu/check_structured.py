"""Structured outputs on the GPU: the CUDA bitmask path against the CPU one, the per-step
mask cost at a Llama-3-sized vocabulary, and constrained generation end to end.

1. The same matchers' masks applied to CUDA and to CPU logits give the same -inf positions.
2. Host cost of filling the bitmasks for B requests over a 128,256-token vocabulary (a
   synthetic byte vocabulary: the 8B shape has no tokenizer here), and the apply on the GPU.
3. The shipped model in float32 on the GPU: JSON-schema and regex outputs are valid.
Prints RESULT lines; writes $OUT/check_structured.json.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from llmserve import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from llmserve.config import TINY_MODEL_DIR  # noqa: E402
from llmserve.engine.structured_output import StructuredOutputs, apply_grammar_masks  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
DEVICE = os.environ.get("DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer"},
          "name": {"type": "string", "maxLength": 12}}, "required": ["answer", "score", "name"],
          "additionalProperties": False}  # fmt: skip
REGEX = r"\d{3}-[a-z]{2}"


class _Row:
    def __init__(self, matcher):
        self.matcher = matcher


def masks_agree() -> dict:
    structured = StructuredOutputs(str(TINY_MODEL_DIR), 4096)
    rows = [_Row(structured.matcher(StructuredOutputsParams(json=SCHEMA), [2])), _Row(None),
            _Row(structured.matcher(StructuredOutputsParams(regex=REGEX), [2]))]  # fmt: skip
    cpu = torch.randn(3, 4096)
    gpu = cpu.to(DEVICE)
    apply_grammar_masks(cpu, rows)
    apply_grammar_masks(gpu, rows)
    return {"same_masked_positions": bool(torch.equal(torch.isinf(cpu), torch.isinf(gpu.cpu()))),
            "allowed_json": int(torch.isfinite(cpu[0]).sum()), "allowed_regex": int(torch.isfinite(cpu[2]).sum())}


def mask_cost(batch: int, vocab: int = 128256) -> dict:
    import xgrammar as xgr

    rng = random.Random(0)
    pieces = [bytes([b]) for b in range(256)]
    while len(pieces) < vocab - 1:
        pieces.append(bytes(rng.randrange(97, 123) for _ in range(rng.randint(2, 8))))
    pieces.append(b"</s>")
    info = xgr.TokenizerInfo(pieces, xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=[vocab - 1])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    start = time.perf_counter()
    grammar = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - start
    rows = [_Row(xgr.GrammarMatcher(grammar)) for _ in range(batch)]
    logits = torch.randn(batch, vocab, device=DEVICE)
    apply_grammar_masks(logits, rows)  # warm-up
    times = []
    for _ in range(5):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        apply_grammar_masks(logits, rows)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"batch": batch, "vocab": vocab, "compile_ms": round(compile_s * 1000, 1),
            "mask_ms_median": round(sorted(times)[2] * 1000, 2)}


def generate() -> dict:
    kwargs = {"dtype": "float32", "gpu_memory_utilization": 0.3} if DEVICE == "cuda" else {}
    llm = LLM(str(TINY_MODEL_DIR), device=DEVICE, max_model_len=512, **kwargs)
    specs = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX)] * 8
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured_outputs=s) for i, s in enumerate(specs)]
    outs = llm.generate(["Describe a list in Python:"] * len(specs), params, use_tqdm=False)
    valid = 0
    for spec, out in zip(specs, outs):
        text = out.outputs[0].text
        try:
            ok = re.fullmatch(REGEX, text) is not None if spec.regex else set(json.loads(text)) == set(SCHEMA["required"])
        except ValueError:
            ok = False
        valid += ok
    return {"valid": valid, "requests": len(specs)}


def main() -> None:
    results = {"device": DEVICE, "masks_agree": masks_agree()}
    print("RESULT masks", results["masks_agree"], flush=True)
    results["mask_cost"] = [mask_cost(b) for b in (1, 32, 256)]
    for r in results["mask_cost"]:
        print("RESULT mask cost", r, flush=True)
    results["generate"] = generate()
    print("RESULT generate", results["generate"], flush=True)
    (OUT / "check_structured.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
