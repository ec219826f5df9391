"""GPU check of prompt logprobs (run on the device machine): a float32 random Llama on the GPU
path (Triton attention, CUDA graphs for decode and piecewise graphs for mixed steps, async
scheduling), with chunked prefill and a prefix cache, asked for prompt logprobs through the
one-pass kernel (k <= 8) and through the tensor ops (k > 8): each prompt position's logprob,
rank and top ids against transformers' log-softmax on the same GPU; and the greedy tokens of
the same prompts with and without prompt logprobs equal. Prints RESULT lines; writes
$OUT/check_prompt_logprobs.json."""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.model.random_model import make_random_model  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))


def main() -> None:
    from transformers import AutoModelForCausalLM

    model_dir = make_random_model(Path(tempfile.mkdtemp()) / "llama", "llama", seed=3, vocab_size=512)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 19, 41, 70, 130)]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        ref = [torch.log_softmax(hf(torch.tensor([p], device="cuda")).logits[0].float(), dim=-1).cpu() for p in prompts]
    del hf
    results = {}
    with LLM(str(model_dir), dtype="float32", max_model_len=256, max_num_batched_tokens=64) as llm:
        plain = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8,
                             ignore_eos=True), use_tqdm=False)  # fmt: skip
        for k in (5, 12):  # the kernel's path, the tensor ops'
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=k)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            worst, ranks_ok, tops_ok = 0.0, True, True
            for out, prompt, row_lps in zip(outs, prompts, ref):
                assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
                for p in range(1, len(prompt)):
                    entry, row, token = out.prompt_logprobs[p], row_lps[p - 1], prompt[p]
                    worst = max(worst, abs(entry[token].logprob - row[token].item()))
                    ranks_ok &= entry[token].rank == 1 + int((row > row[token]).sum())
                    top = [t for t, e in sorted(entry.items(), key=lambda x: x[1].rank) if e.rank <= k]
                    tops_ok &= top == row.topk(k).indices.tolist()
            same = [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
            results[f"k{k}"] = dict(max_abs_diff=worst, ranks=ranks_ok, top_ids=tops_ok, same_tokens=same)
            print(f"RESULT prompt_logprobs k={k}: max |logprob - transformers| {worst:.2e}, ranks {ranks_ok}, "
                  f"top ids {tops_ok}, tokens as without {same}")
        graphs = llm.core.runner.graphs is not None, llm.core.runner.mixed_graphs is not None
        print(f"RESULT CUDA graphs (decode, piecewise): {graphs}; blocks used after: {llm.stats().num_blocks_used}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "check_prompt_logprobs.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
