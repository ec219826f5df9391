"""Prompt logprobs on the GPU path (was scripts/gpu/check_prompt_logprobs.py): a float32 random Llama
with Triton attention, CUDA graphs for decode and piecewise graphs for mixed steps, async scheduling,
chunked prefill and a prefix cache, asked for prompt logprobs through the one-pass kernel (k <= 8) and
through the tensor ops (k > 8). Each prompt position's logprob, rank and top ids equal transformers'
log-softmax on the same GPU, and the greedy tokens equal those of the same prompts without them."""

from __future__ import annotations

import random

import pytest
import torch
from gpu_utils import free_device_memory, release, token_ids  # noqa: F401

from llmserve import LLM, SamplingParams
from llmserve.model.random_model import make_random_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("k", [5, 12])  # the kernel's path, the tensor ops'
def test_prompt_logprobs_equal_transformers(tmp_path, k):
    from transformers import AutoModelForCausalLM

    model_dir = make_random_model(tmp_path / "llama", "llama", seed=3, vocab_size=512)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 19, 41, 70, 130)]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        ref = [torch.log_softmax(hf(torch.tensor([p], device="cuda")).logits[0].float(), dim=-1).cpu() for p in prompts]
    del hf
    release()
    with LLM(str(model_dir), dtype="float32", max_model_len=256, max_num_batched_tokens=64) as llm:
        assert llm.core.runner.graphs is not None and llm.core.runner.mixed_graphs is not None
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        plain = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=k)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for out, prompt, row_lps in zip(outs, prompts, ref):
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
            for p in range(1, len(prompt)):
                entry, row, token = out.prompt_logprobs[p], row_lps[p - 1], prompt[p]
                assert abs(entry[token].logprob - row[token].item()) < 1e-3
                assert entry[token].rank == 1 + int((row > row[token]).sum())
                top = [t for t, e in sorted(entry.items(), key=lambda x: x[1].rank) if e.rank <= k]
                assert top == row.topk(k).indices.tolist()
        assert token_ids(outs) == token_ids(plain)
        assert llm.stats().num_blocks_used == 0
