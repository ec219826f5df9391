"""Structured outputs on the GPU (was scripts/gpu/check_structured.py): the CUDA bitmask path masks
exactly what the CPU one does, and constrained generation on the GPU gives valid outputs. (The per-step
mask cost at a 128,256-token vocabulary is in docs/history/benchmarks.md, 2026-11-29.)"""

from __future__ import annotations

import json
import re

import pytest
import torch
from gpu_utils import free_device_memory  # noqa: F401

from llmserve import LLM, SamplingParams, StructuredOutputsParams
from llmserve.config import TINY_MODEL_DIR
from llmserve.engine.structured_output import StructuredOutputs, apply_grammar_masks

pytestmark = pytest.mark.gpu

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer"},
          "name": {"type": "string", "maxLength": 12}}, "required": ["answer", "score", "name"],
          "additionalProperties": False}  # fmt: skip
REGEX = r"\d{3}-[a-z]{2}"


class _Row:
    def __init__(self, matcher):
        self.matcher = matcher


def test_cuda_masks_equal_cpu_masks():
    structured = StructuredOutputs(str(TINY_MODEL_DIR), 4096)
    rows = [_Row(structured.matcher(StructuredOutputsParams(json=SCHEMA), [2])), _Row(None),
            _Row(structured.matcher(StructuredOutputsParams(regex=REGEX), [2]))]  # fmt: skip
    cpu = torch.randn(3, 4096)
    gpu = cpu.to("cuda")
    apply_grammar_masks(cpu, rows)
    apply_grammar_masks(gpu, rows)
    assert torch.equal(torch.isinf(cpu), torch.isinf(gpu.cpu()))
    assert 0 < int(torch.isfinite(cpu[0]).sum()) < 4096 and 0 < int(torch.isfinite(cpu[2]).sum()) < 4096
    assert bool(torch.isfinite(cpu[1]).all())  # the unconstrained row


def test_constrained_generation_on_the_gpu_is_valid():
    llm = LLM(str(TINY_MODEL_DIR), device="cuda", dtype="float32", gpu_memory_utilization=0.3, max_model_len=512)
    specs = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX)] * 8
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured_outputs=s) for i, s in enumerate(specs)
    ]
    outs = llm.generate(["Describe a list in Python:"] * len(specs), params, use_tqdm=False)
    finished = [(spec, out.outputs[0].text) for spec, out in zip(specs, outs) if out.outputs[0].finish_reason == "stop"]
    assert len(finished) >= len(specs) // 2  # the rest ran into max_tokens (an integer's digits may go on)
    for spec, text in finished:
        if spec.regex:
            assert re.fullmatch(REGEX, text), text
        else:
            assert set(json.loads(text)) == set(SCHEMA["required"]), text
