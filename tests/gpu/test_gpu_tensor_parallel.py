"""Tensor parallelism on two GPUs (was scripts/gpu/check_tp.py): a small float32 random Llama's greedy
tokens with TP=2 (NCCL, Triton kernels, CUDA graphs and eager) equal TP=1 eager on one GPU; a TP engine
also starts again in the same process after one with CUDA graphs shut down (its graphs must go before
its process group). Skipped with fewer than two GPUs."""

from __future__ import annotations

import pytest
import torch
from gpu_utils import free_device_memory, random_prompts, release, token_ids  # noqa: F401

from llmserve import LLM, SamplingParams
from llmserve.model.random_model import make_random_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs two GPUs")]  # fmt: skip

# in this order: TP=2 eager again after the graphs engine is the clean-teardown check
VARIANTS = {
    "tp1 graphs": {},
    "tp2 eager": {"tensor_parallel_size": 2, "enforce_eager": True},
    "tp2 graphs": {"tensor_parallel_size": 2},
    "tp2 eager again": {"tensor_parallel_size": 2, "enforce_eager": True},
}
PROMPTS = random_prompts(0, 2000, lengths=(6, 20, 42, 71, 131, 251))


def greedy(path: str, **kw) -> list[list[int]]:
    with LLM(path, device="cuda", dtype="float32", max_model_len=512, gpu_memory_utilization=0.3, **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=48),
                            use_tqdm=False)  # fmt: skip
    return token_ids(outs)


@pytest.fixture(scope="module")
def model_and_reference(tmp_path_factory) -> tuple[str, list[list[int]]]:
    path = str(make_random_model(tmp_path_factory.mktemp("tp") / "m", "llama", seed=1, vocab_size=2001, hidden_size=512,
                                 intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                                 num_key_value_heads=4))  # fmt: skip
    reference = greedy(path, enforce_eager=True)
    release()
    return path, reference


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp_greedy_equals_tp1_eager(model_and_reference, variant):
    path, reference = model_and_reference
    assert greedy(path, **VARIANTS[variant]) == reference
