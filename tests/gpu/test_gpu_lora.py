"""LoRA on the GPU (was scripts/gpu/lora_kernels_check.py and lora_engine_check.py).

Kernels, at Llama-3.1-8B shapes (hidden 4096, q 4096, k/v 1024, MLP 14336), 8 slots of ranks 8 and 16:
- shrink and expand (split partial sums, and the expand as one GEMM) against the PyTorch reference, in
  float32, float16 and bfloat16, for 1 to 2,048 tokens, some without an adapter;
- a LoRALinear captured once in a CUDA graph and replayed over other mixes of adapters equals eager;
- the adapter on a second stream gives the in-order result bit for bit, eager and replayed.
Engine: a float32 random Llama, 4 adapters and the base, 20 greedy requests in one `generate`: CUDA
graphs (adapters overlapped, or all in order) give eager's tokens; adapter requests differ from the
base model's, base requests equal it.
"""

from __future__ import annotations

import pytest
import torch
from gpu_utils import free_device_memory, release, token_ids  # noqa: F401

from llmserve import LLM, LoRARequest, SamplingParams
from llmserve.kernels.lora import lora_expand, lora_shrink
from llmserve.lora.apply import LoRALinear
from llmserve.lora.context import LoRAContext
from llmserve.lora.expand_gemm import lora_expand_gemm
from llmserve.lora.ops import triton_lora_ops
from llmserve.lora.reference import lora_expand_reference, lora_shrink_reference
from llmserve.lora.slot_weights import ProjectionLoRA
from llmserve.lora.synthetic import write_random_adapter
from llmserve.model.random_model import make_random_model

pytestmark = pytest.mark.gpu

SLOTS, MAX_RANK = 8, 16
PROJ = {"qkv_proj": (4096, [4096, 1024, 1024]), "o_proj": (4096, [4096]), "gate_up_proj": (4096, [14336, 14336]),
        "down_proj": (14336, [4096])}  # fmt: skip
EPS = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def weights(in_features: int, widths: list[int], dtype: torch.dtype, gen: torch.Generator) -> ProjectionLoRA:
    dev = torch.device("cuda")
    a = torch.zeros(SLOTS, len(widths), MAX_RANK, in_features, device=dev)
    b = torch.zeros(SLOTS, sum(widths), MAX_RANK, device=dev)
    for s in range(SLOTS):
        rank = 16 if s % 2 else 8
        a[s, :, :rank] = torch.randn(len(widths), rank, in_features, generator=gen, device=dev) / in_features**0.5
        b[s, :, :rank] = torch.randn(sum(widths), rank, generator=gen, device=dev) / rank**0.5
    offsets = torch.tensor([0, *torch.tensor(widths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    scaling = torch.rand(SLOTS, generator=gen, device=dev) + 0.5
    return ProjectionLoRA(a.to(dtype), b.to(dtype), scaling, offsets, max(widths), tuple(offsets.tolist()))


def token_slots(n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(-1, SLOTS, (n,), generator=gen, device="cpu").tolist()


def replayed_max_abs(captured, reference, x: torch.Tensor, new_slots, replays: int) -> float:
    """`captured(x)` captured once in a CUDA graph, then replayed `replays` times after new token slots;
    the largest difference from `reference(x)` run eagerly."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = captured(x)
    worst = 0.0
    for _ in range(replays):
        new_slots()
        graph.replay()
        want = reference(x)
        torch.cuda.synchronize()
        worst = max(worst, (out.float() - want.float()).abs().max().item())
    return worst


@pytest.mark.parametrize("proj", list(PROJ))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_shrink_and_expand_against_the_reference(dtype, proj):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    in_features, widths = PROJ[proj]
    w = weights(in_features, widths, dtype, gen)
    for n in (1, 7, 64, 300, 2048):
        ctx = LoRAContext(4096, SLOTS, dev)
        slots = token_slots(n, cpu_gen)
        ctx.set_token_slots(slots)
        batch = ctx.batch(n)
        rows_used = torch.tensor([s >= 0 for s in slots], device=dev)  # the shrink writes only these
        x = torch.randn(n, in_features, generator=gen, device=dev).to(dtype)
        t, t_ref = lora_shrink(x, w.a, w.scaling, batch), lora_shrink_reference(x, w.a, w.scaling, batch)
        y0 = torch.randn(n, sum(widths), generator=gen, device=dev).to(dtype)
        y, y_split, y_gemm, y_ref = y0.clone(), y0.clone(), y0.clone(), y0.clone()
        lora_expand(y, t_ref, w.b, w.slice_offsets, w.max_slice_width, batch)
        lora_expand(y_split, t, w.b, w.slice_offsets, w.max_slice_width, batch)  # the partial sums
        lora_expand_gemm(y_gemm, t, w.b_all, w.slice_bounds, batch)
        lora_expand_reference(y_ref, t_ref, w.b, w.slice_offsets, w.max_slice_width, batch)
        torch.cuda.synchronize()
        shrink_err = (t.sum(0)[rows_used] - t_ref[rows_used]).abs().max().item() if bool(rows_used.any()) else 0.0
        assert shrink_err <= 1e-4 * max(1.0, t_ref.abs().max().item()), (n, shrink_err)
        # an expand result may differ from the reference by a rounding of y (as large as y) and by the
        # delta's own sum order: under 1 % of the largest delta (0.39 % on an H200, 2026-12-01)
        tol = 0.01 * (y_ref.float() - y0.float()).abs().max().item() + 2 * EPS[dtype] * y_ref.float().abs().max().item()
        for name, got in (("expand", y), ("split", y_split), ("gemm", y_gemm)):
            err = (got.float() - y_ref.float()).abs().max().item()
            assert err <= tol, (name, n, err, tol)


def test_a_lora_linear_replayed_from_a_cuda_graph_equals_eager():
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    cpu_gen = torch.Generator().manual_seed(1)
    in_features, widths = PROJ["qkv_proj"]
    base = torch.nn.Linear(in_features, sum(widths), bias=False, device=dev, dtype=torch.bfloat16)
    n = 64
    ctx = LoRAContext(256, SLOTS, dev, always_apply=True)
    layer = LoRALinear(base, weights(in_features, widths, torch.bfloat16, gen), ctx, triton_lora_ops())
    x = torch.randn(n, in_features, generator=gen, device=dev).to(torch.bfloat16)
    ctx.set_token_slots([-1] * n)
    with torch.inference_mode():
        layer(x)  # compile outside the capture
        # (3 padding rows: no slot)
        worst = replayed_max_abs(layer, layer, x, lambda: ctx.set_token_slots(token_slots(n - 3, cpu_gen)), 5)
    assert worst == 0.0


@pytest.mark.parametrize("proj", list(PROJ))
def test_the_adapter_on_a_second_stream_equals_in_order(proj):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(3)
    cpu_gen = torch.Generator().manual_seed(3)
    side = torch.cuda.Stream(dev)
    in_features, widths = PROJ[proj]
    base = torch.nn.Linear(in_features, sum(widths), bias=False, device=dev, dtype=torch.bfloat16)
    w = weights(in_features, widths, torch.bfloat16, gen)
    for n in (1, 8):
        ctx = LoRAContext(256, SLOTS, dev, always_apply=True)
        plain = LoRALinear(base, w, ctx, triton_lora_ops())
        over = LoRALinear(base, w, ctx, triton_lora_ops(overlap_max_tokens=16), side=side)
        x = torch.randn(n, in_features, generator=gen, device=dev).to(torch.bfloat16)
        with torch.inference_mode():
            ctx.set_token_slots(token_slots(n, cpu_gen))
            assert (plain(x).float() - over(x).float()).abs().max().item() == 0.0
            assert replayed_max_abs(over, plain, x, lambda: ctx.set_token_slots(token_slots(n, cpu_gen)), 3) == 0.0


PROMPTS = [{"prompt_token_ids": [(17 * i + 5 * j) % 4000 + 10 for j in range(12 + i)]} for i in range(20)]
PARAMS = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def lora_engine(model: str, eager: bool, overlap: int) -> LLM:
    # a fixed KV size: engines one after another in this process, whatever memory the last one left
    return LLM(model=model, dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16, max_model_len=256,
               max_num_seqs=32, enforce_eager=eager, lora_cuda_graphs=not eager, kv_cache_memory_bytes=1 << 30,
               lora_overlap_tokens=overlap)  # fmt: skip


@pytest.fixture(scope="module")
def eager_run(tmp_path_factory):
    """The model, the requests' adapters (every fifth request on the base), and the eager engine's tokens
    with the adapters and without."""
    work = tmp_path_factory.mktemp("lora_engine")
    model = str(make_random_model(work / "model", "llama", vocab_size=4096, hidden_size=512, intermediate_size=1536,
                                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                  max_position_embeddings=2048))  # fmt: skip
    llm = lora_engine(model, eager=True, overlap=64)
    arch = llm.config.model_config.arch
    loras = [LoRARequest(f"a{k}", k + 1, str(write_random_adapter(arch, work / f"a{k}", (8, 16)[k % 2], k)))
             for k in range(4)]  # fmt: skip
    per_request = [None if i % 5 == 4 else loras[i % 5] for i in range(len(PROMPTS))]
    tokens = token_ids(llm.generate(PROMPTS, PARAMS, lora_request=per_request, use_tqdm=False))
    base = token_ids(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    llm.shutdown()
    del llm
    release()
    return model, per_request, tokens, base


def test_eager_adapters_change_the_tokens_of_their_requests_only(eager_run):
    _, per_request, tokens, base = eager_run
    for lora, got, plain in zip(per_request, tokens, base):
        assert (got != plain) if lora is not None else (got == plain)


@pytest.mark.parametrize("overlap", [64, 0], ids=["overlapped", "in_order"])
def test_cuda_graphs_with_adapters_give_eager_tokens(eager_run, overlap):
    model, per_request, want, _ = eager_run
    llm = lora_engine(model, eager=False, overlap=overlap)
    assert token_ids(llm.generate(PROMPTS, PARAMS, lora_request=per_request, use_tqdm=False)) == want
    llm.shutdown()


@pytest.fixture(scope="module")
def quantized_bases(tmp_path_factory):
    """One float32 Llama as three quantized bases (W8A8 INT8 at load, a GPTQ checkpoint, a GGUF file
    of K-quants kept quantized), and four adapters."""
    from llmserve.model.arch import read_model_arch
    from llmserve.model.gguf.writer import write_gguf
    from llmserve.model.w4a16_checkpoint import write_w4a16_checkpoint

    work = tmp_path_factory.mktemp("lora_quantized")
    model = make_random_model(work / "model", "llama", vocab_size=4096, hidden_size=512, intermediate_size=1536,
                              num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                              max_position_embeddings=2048)  # fmt: skip
    types = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q8_0", "gate_proj": "Q5_K",
             "up_proj": "Q5_K", "down_proj": "Q6_K"}  # fmt: skip
    gguf = write_gguf(model, work / "model.gguf", lambda hf: types.get(hf.split(".")[-2], "F16"))
    gptq = write_w4a16_checkpoint(str(model), work / "gptq", "gptq", 128, False, True)
    arch = read_model_arch(model)
    loras = [LoRARequest(f"a{k}", k + 1, str(write_random_adapter(arch, work / f"a{k}", (8, 16)[k % 2], k)))
             for k in range(4)]  # fmt: skip
    return {"int8": (str(model), {"quantization": "int8"}), "gptq": (str(gptq), {}),
            "gguf": (str(gguf), {"gguf_keep_quantized": True})}, loras  # fmt: skip


@pytest.mark.parametrize("base", ["int8", "gptq", "gguf"])
def test_adapters_on_quantized_bases_in_cuda_graphs_give_eager_tokens(quantized_bases, base):
    """Each base's kernels under the adapters (decode batches of up to 16 rows take the
    dequant-in-the-GEMM kernels): CUDA graphs with the adapters overlapped give eager's tokens, and
    the adapters change their requests' tokens."""
    bases, loras = quantized_bases
    model, kwargs = bases[base]
    prompts, params = PROMPTS[:12], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    per_request = [None if i % 5 == 4 else loras[i % 5] for i in range(len(prompts))]
    runs = {}
    for eager in (True, False):
        llm = LLM(model=model, dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16, max_model_len=256,
                  max_num_seqs=16, enforce_eager=eager, lora_cuda_graphs=not eager, kv_cache_memory_bytes=1 << 30,
                  **kwargs)  # fmt: skip
        assert llm.config.model_config.quantization == {"int8": "int8", "gptq": "gptq", "gguf": "gguf"}[base]
        runs[eager] = token_ids(llm.generate(prompts, params, lora_request=per_request, use_tqdm=False))
        if eager:
            plain = token_ids(llm.generate(prompts, params, use_tqdm=False))
        llm.shutdown()
        del llm
        release()
    assert runs[False] == runs[True]
    for lora, got, want in zip(per_request, runs[True], plain):
        assert (got != want) if lora is not None else (got == want)
