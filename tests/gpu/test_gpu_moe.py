"""Mixture of experts on the GPU (issue 52):
1. the fused MoE kernels (kernels/fused_moe.py) compiled, against the PyTorch reference (model/moe.py):
   float32 tightly, bf16 within the reference's own bf16 rounding, from one decode token to a
   prefill's worth, on a small shape and on Qwen3-30B-A3B's (128 experts, top 8, 2048 x 768);
2. a CUDA graph captured around them replays a new routing;
3. the MoE families' float32 random models through the engine on the GPU path (Triton kernels, CUDA
   graphs, chunked prefill) give transformers' greedy tokens on the same GPU.
"""

from __future__ import annotations

import pytest
import torch
from gpu_utils import free_device_memory, random_prompts, release  # noqa: F401

from llmserve.kernels import fused_moe as fm
from llmserve.model.moe import fused_moe_reference, route_reference

pytestmark = pytest.mark.gpu

SHAPES = {"small": (8, 2, 256, 128), "qwen3-30b-a3b": (128, 8, 2048, 768)}  # experts, top_k, hidden, inter


def _inputs(shape: str, tokens: int, dtype: torch.dtype, seed: int = 0):
    experts, top_k, hidden, inter = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
    logits = torch.randn(tokens, experts, generator=gen, device="cuda").to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen, device="cuda") * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen, device="cuda") * inter**-0.5).to(dtype)
    return x, logits, w13, w2, top_k


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("tokens", [1, 7, 64, 512, 2048])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fused_moe_equals_the_reference(shape, tokens):
    x, logits, w13, w2, top_k = _inputs(shape, tokens, torch.float32)
    _, ids = fm.route(logits, top_k, True)
    assert torch.equal(ids.long(), route_reference(logits, top_k, True)[1])
    exact = fused_moe_reference(x, logits, w13, w2, top_k, True)
    assert _rel(fm.fused_moe(x, logits, w13, w2, top_k, True), exact) < 1e-5
    xb, lb, w13b, w2b = (t.to(torch.bfloat16) for t in (x, logits, w13, w2))
    want = fused_moe_reference(*(t.float() for t in (xb, lb, w13b, w2b)), top_k, True)  # bf16 inputs, fp32 math
    got = fm.fused_moe(xb, lb, w13b, w2b, top_k, True)
    assert got.dtype == torch.bfloat16
    assert _rel(got, want) <= max(1.5 * _rel(fused_moe_reference(xb, lb, w13b, w2b, top_k, True), want), 4e-3)


@pytest.mark.parametrize("tokens", [1, 2, 4])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_decode_variant_equals_the_grouped_kernels(shape, tokens):
    """The decode variant (kernels/fused_moe.py: GEMVs over the (token, slot) rows, no align step)
    against the reference in float32 and within bf16's rounding of the grouped kernels in bf16;
    and inside a CUDA graph, replayed on a new routing."""
    x, logits, w13, w2, top_k = _inputs(shape, tokens, torch.float32)
    exact = fused_moe_reference(x, logits, w13, w2, top_k, True)
    assert _rel(fm.fused_moe(x, logits, w13, w2, top_k, True, decode=True), exact) < 1e-5
    xb, lb, w13b, w2b = (t.to(torch.bfloat16) for t in (x, logits, w13, w2))
    want = fused_moe_reference(*(t.float() for t in (xb, lb, w13b, w2b)), top_k, True)
    grouped = fm.fused_moe(xb, lb, w13b, w2b, top_k, True, decode=False)
    got = fm.fused_moe(xb, lb, w13b, w2b, top_k, True, decode=True)
    assert _rel(got, want) <= max(1.5 * _rel(grouped, want), 4e-3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe(xb, lb, w13b, w2b, top_k, True, decode=True)
    x2, l2, *_ = _inputs(shape, tokens, torch.bfloat16, seed=1)
    xb.copy_(x2)
    lb.copy_(l2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fm.fused_moe(xb, lb, w13b, w2b, top_k, True, decode=True))


def test_a_cuda_graph_replays_a_new_routing():
    x, logits, w13, w2, top_k = _inputs("small", 16, torch.bfloat16)
    fm.fused_moe(x, logits, w13, w2, top_k, False)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe(x, logits, w13, w2, top_k, False)
    x2, logits2, *_ = _inputs("small", 16, torch.bfloat16, seed=1)
    x.copy_(x2)
    logits.copy_(logits2)
    graph.replay()
    torch.testing.assert_close(out, fm.fused_moe(x2, logits2, w13, w2, top_k, False), atol=0, rtol=0)


def hf_greedy_moe(path: str, prompts: list[list[int]], max_new: int, experts: str) -> list[list[int]]:
    """transformers' generate() on the GPU, float32, its experts run by `experts` ("eager": the loop
    over experts; "grouped_mm": its default on CUDA, torch's grouped GEMM)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation=experts)
    model = model.cuda().eval()
    with torch.no_grad():
        outs = [model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=max_new, do_sample=False,
                               pad_token_id=0)[0, len(ids) :].tolist() for ids in prompts]  # fmt: skip
    del model
    release()
    return outs


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_families_on_the_gpu_path_give_transformers_tokens(tmp_path, family):
    """The oracle is transformers' loop over experts in float32 (its grouped GEMM default is printed
    beside it: on CUDA it need not be float32-exact)."""
    from llmserve import LLM, SamplingParams
    from llmserve.model.random_model import make_random_model

    path = str(make_random_model(tmp_path / family, family, seed=3, hidden_size=128, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=32))  # fmt: skip
    prompts = random_prompts(7, 500)
    want = hf_greedy_moe(path, prompts, 24, "eager")
    print(family, "transformers grouped_mm == eager:", hf_greedy_moe(path, prompts, 24, "grouped_mm") == want)
    # the reference path on the GPU; the Triton path with CUDA graphs (whole and piecewise); chunked prefill
    for options in (dict(attention_backend="reference", enforce_eager=True), dict(), dict(max_num_batched_tokens=16)):
        llm = LLM(path, device="cuda", dtype="float32", max_model_len=256, gpu_memory_utilization=0.3,
                  **{"attention_backend": "triton", **options})  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=24),
                            use_tqdm=False)  # fmt: skip
        assert [o.outputs[0].token_ids for o in outs] == want, options
        del llm
