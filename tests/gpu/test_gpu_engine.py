"""The whole engine on the GPU (was scripts/gpu/check_engine.py).

1. Small float32 random models of every architecture: the GPU path's greedy tokens (Triton attention,
   CUDA graphs: whole graphs for decode steps, piecewise graphs for steps with prefill tokens, or those
   eager) equal the PyTorch reference path's and transformers' generate() on the same GPU.
2. bf16, a ~1B-shaped random model: the engine's token equals transformers' bf16 argmax under teacher
   forcing at nearly every position (rounding in bf16 flips near-ties: 93.6 % on an H200, 2026-11-29).
"""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILY_OVERRIDES
from gpu_utils import free_device_memory, hf_greedy_cuda, random_prompts, release, token_ids  # noqa: F401

from llmserve import LLM, SamplingParams
from llmserve.model.random_model import make_random_model

pytestmark = pytest.mark.gpu

VARIANTS = {
    "reference-eager": dict(attention_backend="reference", enforce_eager=True),
    "triton-eager": dict(attention_backend="triton", enforce_eager=True),
    "triton-graphs": dict(attention_backend="triton"),
    "triton-graphs-chunked16": dict(attention_backend="triton", max_num_batched_tokens=16),
    "triton-graphs-no-piecewise": dict(attention_backend="triton", max_mixed_graph_tokens=0),
}


@pytest.fixture(scope="module")
def float32_models(tmp_path_factory) -> dict[str, tuple[str, list[list[int]], list[list[int]]]]:
    """Per family: the model folder, its prompts, and transformers' greedy tokens on the GPU."""
    root = tmp_path_factory.mktemp("gpu_models")
    models = {}
    for i, (family, overrides) in enumerate(FAMILY_OVERRIDES.items()):
        path = str(make_random_model(root / family, family, seed=i, hidden_size=128, intermediate_size=256,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, **overrides))  # fmt: skip
        prompts = random_prompts(i, 500)
        models[family] = (path, prompts, hf_greedy_cuda(path, prompts, 32))
    return models


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("family", list(FAMILY_OVERRIDES))
def test_float32_greedy_equals_transformers(float32_models, family, variant):
    path, prompts, want = float32_models[family]
    llm = LLM(path, device="cuda", dtype="float32", max_model_len=256, gpu_memory_utilization=0.3, **VARIANTS[variant])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=32),
                        use_tqdm=False)  # fmt: skip
    assert token_ids(outs) == want


def test_bf16_agrees_with_transformers_under_teacher_forcing(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path / "llama-1b"
    make_random_model(path, "llama", config_only=True, vocab_size=32000)
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                         rope_theta=500000.0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(path)
    prompts = random_prompts(7, 32000, lengths=[16 + 8 * i for i in range(32)])
    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)  # fmt: skip
    agree = total = 0
    model.eval()
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            got = list(out.outputs[0].token_ids)
            logits = model(torch.tensor([prompt + got], device="cuda")).logits[0, len(prompt) - 1 : -1]
            agree += sum(a == b for a, b in zip(logits.argmax(-1).tolist(), got))
            total += len(got)
    del model
    release()
    assert agree / total >= 0.9, f"{agree} of {total} positions agree"
