"""Shared by the GPU tier (tests/gpu/, `pytest -m gpu` on a machine with CUDA)."""

from __future__ import annotations

import gc
import random

import pytest
import torch


@pytest.fixture(autouse=True)
def free_device_memory():
    """Each test's engines start with the device memory earlier tests' engines held given back (an engine
    sizes its KV cache from what is free)."""
    release()
    yield
    release()


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def random_prompts(seed: int, vocab: int, lengths=(5, 19, 41, 70, 130)) -> list[list[int]]:
    """Token-id prompts starting with token 1, the rest drawn from [3, vocab)."""
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, vocab) for _ in range(n - 1)] for n in lengths]


def hf_greedy_cuda(path: str, prompts: list[list[int]], max_new: int, dtype=torch.float32) -> list[list[int]]:
    """The oracle on the GPU: transformers' generate(), greedy, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            gen = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=max_new, do_sample=False,
                                 pad_token_id=0)  # fmt: skip
            outs.append(gen[0, len(ids) :].tolist())
    del model
    release()
    return outs


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]
