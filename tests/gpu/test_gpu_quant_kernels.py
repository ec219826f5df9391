"""The quantized-weight kernels compiled for the GPU against their PyTorch references, at shapes the
CPU tests (Triton's interpreter, tiny shapes) cannot reach: W8A8 INT8 (exact: int32 sums), W4A16
(GPTQ/AWQ groups, act-order), GGUF kept quantized (Q8_0, Q5_0, Q4_K, Q5_K, Q6_K) and the fused
MoE kernels on FP8 experts (per channel and per 128 x 128 block); the INT8, W4A16 and GGUF kernels
split along K at decode (kernels/quant_split_k.py) against the same kernels unsplit, eager and
replayed from CUDA graphs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpu_utils import free_device_memory  # noqa: F401

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("m", [1, 16, 300])
@pytest.mark.parametrize(("k", "n"), [(4096, 1024), (1024, 6144)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_int8_gemms_equal_the_integer_reference(m, k, n, out_dtype):
    from llmserve.kernels.int8_linear import int8_gemm_fast, int8_gemm_triton
    from llmserve.model.int8 import int8_gemm_reference, quantize_rows_int8, quantize_tokens_int8

    gen = _gen(m + k)
    xq, sx = quantize_tokens_int8(torch.randn(m, k, generator=gen) * 4)
    wq, sw = quantize_rows_int8(torch.randn(n, k, generator=gen) * 0.05)
    xq, sx, wq, sw = (t.to(CUDA) for t in (xq, sx, wq, sw))
    want = int8_gemm_reference(xq.cpu(), sx.cpu(), wq.cpu(), sw.cpu(), out_dtype).to(CUDA)
    got = int8_gemm_triton(xq, sx, wq, sw, out_dtype)
    assert got.dtype == out_dtype
    # int32 sums are exact in any order; the epilogue's float rounding may differ by one ulp
    torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-3 * want.abs().max().item())
    torch.testing.assert_close(int8_gemm_fast(xq, sx, wq, sw, out_dtype), want, rtol=8e-3,
                               atol=1e-3 * want.abs().max().item())  # fmt: skip


@pytest.mark.parametrize("m", [1, 7, 256])
@pytest.mark.parametrize(("k", "n", "group", "act_order"), [(4096, 1024, 128, False), (2048, 512, 32, True),
                                                            (1024, 768, -1, False)])  # fmt: skip
def test_w4a16_kernel_equals_dequantize_then_matmul(m, k, n, group, act_order):
    from llmserve.kernels.w4a16_linear import w4a16_gemm_triton, w4a16_matmul_fast
    from llmserve.model.w4a16 import pack_rows, w4a16_matmul_reference
    from llmserve.model.w4a16_checkpoint import quantize_groups

    gen = _gen(m + k + n)
    q, scales, zeros, g_idx = quantize_groups(torch.randn(n, k, generator=gen) * 0.05, group, False, act_order)
    qweight, scales = pack_rows(q), scales.to(torch.float16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    want = w4a16_matmul_reference(x.float(), qweight, scales, zeros, g_idx)
    args = [t.to(CUDA) if isinstance(t, torch.Tensor) else t for t in (qweight, scales, zeros, g_idx)]
    got = w4a16_gemm_triton(x.to(CUDA), *args)
    assert got.dtype == torch.bfloat16
    tol = dict(rtol=2e-2, atol=2e-2 * want.abs().max().item())
    torch.testing.assert_close(got.float().cpu(), want, **tol)
    torch.testing.assert_close(w4a16_matmul_fast(x.to(CUDA), *args).float().cpu(), want, **tol)


def test_4bit_fast_paths_past_the_triton_rows_capture_in_a_cuda_graph():
    """Steps of more tokens than the Triton kernels take (SMALL_M_ROWS) dequantize and run one GEMM; the
    engine captures those sizes too. A host tensor copied in during the capture (the nibble shifts
    did) failed the capture on the H100 (2026-12-07) and sent every decode step of a GPTQ model to
    eager: each path must capture, and its replays equal its eager call."""
    pytest.importorskip("gguf", reason="the quantizer writes the test weights with gguf (scripts/gpu/fetch_wheels.sh)")
    from llmserve.kernels import gguf_linear, w4a16_linear
    from llmserve.model.gguf.quantize import quantize
    from llmserve.model.gguf_linear import GGUFBlocks
    from llmserve.model.w4a16 import pack_rows
    from llmserve.model.w4a16_checkpoint import quantize_groups

    k, n = 1024, 512
    gen = _gen(k)
    q, scales, zeros, g_idx = quantize_groups(torch.randn(n, k, generator=gen) * 0.05, 128, False, True)
    args = [t.to(CUDA) for t in (pack_rows(q), scales.to(torch.float16), zeros, g_idx)]
    pieces = []
    for type_name in ("Q4_K", "Q6_K", "Q8_0"):
        raw = quantize(torch.randn(n, k, generator=gen).numpy(), type_name).view(np.uint8).reshape(n, -1).copy()
        piece = GGUFBlocks(type_name, n, k)
        piece.load_raw(torch.from_numpy(raw))
        pieces.append(piece.to(CUDA))
    for m in (w4a16_linear.SMALL_M_ROWS + 1, 64):
        x = torch.randn(m, k, generator=gen).to(CUDA, torch.bfloat16)
        calls = [lambda: w4a16_linear.w4a16_matmul_fast(x, *args)]
        calls += [lambda p=p: gguf_linear.gguf_matmul_fast(x, [p]) for p in pieces]
        for fn in calls:
            eager = fn()
            for again in _graph_calls(fn):
                assert torch.equal(again, eager)


@pytest.mark.parametrize("m", [1, 5, 200])
@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_kernels_equal_dequantize_then_matmul(type_name, m):
    pytest.importorskip("gguf", reason="the quantizer writes the test weights with gguf (scripts/gpu/fetch_wheels.sh)")
    from llmserve.kernels.gguf_linear import gguf_gemm_triton
    from llmserve.model.gguf.dequant import dequantize
    from llmserve.model.gguf.quantize import quantize
    from llmserve.model.gguf_linear import GGUFBlocks

    rows, k = 1000, 2048  # rows not a multiple of the kernels' tiles: masked
    w = torch.randn(rows, k, generator=_gen(rows))
    raw = torch.from_numpy(quantize(w.numpy(), type_name).view(np.uint8).reshape(rows, -1).copy())
    piece = GGUFBlocks(type_name, rows, k)
    piece.load_raw(raw)
    x = torch.randn(m, k, generator=_gen(m))
    want = x @ dequantize(raw, type_name, (rows, k)).t()
    fields = {name: t.to(CUDA) for name, t in piece.fields().items()}
    got = gguf_gemm_triton(x.to(CUDA), type_name, fields).float().cpu()
    # float32 activations: the kernel's dot may use TF32 on the GPU
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    got16 = gguf_gemm_triton(x.to(CUDA, torch.bfloat16), type_name, fields).float().cpu()
    want16 = x.to(torch.bfloat16).float() @ dequantize(raw, type_name, (rows, k)).t()
    torch.testing.assert_close(got16, want16, rtol=3e-2, atol=2e-2 * want16.abs().max().item())


def _graph_calls(fn, calls: int = 3) -> list[torch.Tensor]:
    """`fn`'s output after each of `calls` replays of a CUDA graph that holds one call (the split-K
    counters must be all zero again after every call for the next replay to add the right slices)."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    outs = []
    for _ in range(calls):
        graph.replay()
        outs.append(out.clone())
    torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (4096, 14336)])
def test_int8_split_k_equals_the_unsplit_kernel_bit_for_bit(m, n, k):
    """Split-K at decode (kernels/quant_split_k.py): int32 partials, the same epilogue: the same bits
    as the kernel unsplit, in eager and CUDA-graph calls, and the counters zero after."""
    from llmserve.kernels import quant_split_k
    from llmserve.kernels.int8_linear import SPLIT_K_RULE, int8_gemm_triton
    from llmserve.model.int8 import int8_gemm_reference, quantize_rows_int8, quantize_tokens_int8

    gen = _gen(m + n + k)
    xq, sx = quantize_tokens_int8(torch.randn(m, k, generator=gen) * 4)
    wq, sw = quantize_rows_int8(torch.randn(n, k, generator=gen) * 0.05)
    xq, sx, wq, sw = (t.to(CUDA) for t in (xq, sx, wq, sw))
    assert quant_split_k.split_k_count(SPLIT_K_RULE, m, -(-k // 128), -(-n // 64)) > 1  # the rule splits these
    unsplit = int8_gemm_triton(xq, sx, wq, sw, torch.bfloat16, split_k=1)
    got = int8_gemm_triton(xq, sx, wq, sw, torch.bfloat16)
    assert torch.equal(got, unsplit)
    for again in _graph_calls(lambda: int8_gemm_triton(xq, sx, wq, sw, torch.bfloat16)):
        assert torch.equal(again, unsplit)
    assert not quant_split_k.counters(CUDA).any()
    want = int8_gemm_reference(xq.cpu(), sx.cpu(), wq.cpu(), sw.cpu(), torch.bfloat16).float()
    torch.testing.assert_close(got.float().cpu(), want, rtol=8e-3, atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize(("n", "k", "group", "act_order"), [(4096, 4096, 128, False), (4096, 14336, 128, True)])
def test_w4a16_split_k_equals_dequantize_then_matmul(m, n, k, group, act_order):
    """Split-K at decode: within bf16 rounding of the reference, within float32 rounding of the kernel
    unsplit before the output's bf16 rounding, the same bits on every call (eager and graph)."""
    from llmserve.kernels import quant_split_k
    from llmserve.kernels.w4a16_linear import w4a16_gemm_triton
    from llmserve.model.w4a16 import pack_rows, w4a16_matmul_reference
    from llmserve.model.w4a16_checkpoint import quantize_groups

    gen = _gen(m + n + k)
    q, scales, zeros, g_idx = quantize_groups(torch.randn(n, k, generator=gen) * 0.05, group, False, act_order)
    qweight, scales = pack_rows(q), scales.to(torch.float16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    want = w4a16_matmul_reference(x.float(), qweight, scales, zeros, g_idx)
    args = [t.to(CUDA) for t in (qweight, scales, zeros, g_idx)]
    xc = x.to(CUDA)
    got = w4a16_gemm_triton(xc, *args)
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    unsplit = w4a16_gemm_triton(xc, *args, split_k=1)
    torch.testing.assert_close(got, unsplit, rtol=1e-2, atol=1e-2 * unsplit.float().abs().max().item())
    for again in _graph_calls(lambda: w4a16_gemm_triton(xc, *args)):
        assert torch.equal(again, got)
    assert not quant_split_k.counters(CUDA).any()


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "Q6_K"])
def test_gguf_split_k_equals_dequantize_then_matmul(type_name, m):
    pytest.importorskip("gguf", reason="the quantizer writes the test weights with gguf (scripts/gpu/fetch_wheels.sh)")
    from llmserve.kernels import quant_split_k
    from llmserve.kernels.gguf_linear import gguf_gemm_triton
    from llmserve.model.gguf.dequant import dequantize
    from llmserve.model.gguf.quantize import quantize
    from llmserve.model.gguf_linear import GGUFBlocks

    rows, k = 4096, 4096
    w = torch.randn(rows, k, generator=_gen(rows + m))
    raw = torch.from_numpy(quantize(w.numpy(), type_name).view(np.uint8).reshape(rows, -1).copy())
    piece = GGUFBlocks(type_name, rows, k)
    piece.load_raw(raw)
    x = torch.randn(m, k, generator=_gen(m)).to(torch.bfloat16)
    want = x.float() @ dequantize(raw, type_name, (rows, k)).t()
    fields = {name: t.to(CUDA) for name, t in piece.fields().items()}
    xc = x.to(CUDA)
    got = gguf_gemm_triton(xc, type_name, fields)
    torch.testing.assert_close(got.cpu(), want, rtol=3e-2, atol=2e-2 * want.abs().max().item())
    unsplit = gguf_gemm_triton(xc, type_name, fields, split_k=1)
    torch.testing.assert_close(got, unsplit, rtol=1e-4, atol=1e-4 * unsplit.abs().max().item())
    for again in _graph_calls(lambda: gguf_gemm_triton(xc, type_name, fields)):
        assert torch.equal(again, got)
    assert not quant_split_k.counters(CUDA).any()


@pytest.mark.parametrize("tokens", [1, 64, 1024])
@pytest.mark.parametrize("block_shape", [None, (128, 128)])
def test_fp8_fused_moe_equals_the_fp8_reference(tokens, block_shape):
    from llmserve.kernels import fused_moe as fm
    from llmserve.model.fp8 import quantize_rows
    from llmserve.model.fp8_blocks import quantize_blocks
    from llmserve.model.moe import fused_moe_reference

    experts, top_k, hidden, inter = 16, 4, 1024, 768
    gen = _gen(tokens)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    if block_shape is not None:
        (q13, s13), (q2, s2) = quantize_blocks(w13, block_shape), quantize_blocks(w2, block_shape)
        scales = dict(w13_scale=s13, w2_scale=s2, block_shape=block_shape)
    else:
        q13, s13 = quantize_rows(w13.reshape(-1, hidden))
        q2, s2 = quantize_rows(w2.reshape(-1, inter))
        q13, q2 = q13.reshape(w13.shape), q2.reshape(w2.shape)
        scales = dict(w13_scale=s13.reshape(experts, 2 * inter, 1), w2_scale=s2.reshape(experts, hidden, 1))
    # the reference on the kernel's bf16 tokens (it rounds the SiLU-and-mul rows to bf16 before their FP8
    # quantization, as the kernel stores them); on the H100 (2026-12-07), fed float32 tokens, it differed by
    # 3.1-3.5 %: a value near an FP8 rounding boundary lands on the other side (one FP8 step, 6-12 %)
    ref = fused_moe_reference(x.to(torch.bfloat16), logits, q13, q2, top_k, True, **scales).float()
    on = {k: v.to(CUDA) if isinstance(v, torch.Tensor) else v for k, v in scales.items()}
    out = fm.fused_moe(x.to(CUDA, torch.bfloat16), logits.to(CUDA), q13.to(CUDA), q2.to(CUDA), top_k, True, **on)
    assert out.dtype == torch.bfloat16
    got = out.float().cpu()
    assert (got - ref).norm() / ref.norm() < 0.02
    exact = fused_moe_reference(x, logits, w13, w2, top_k, True)
    assert (got - exact).norm() / exact.norm() < 0.08


def test_an_int8_embedding_gives_the_dequantized_tables_tokens(tmp_path):
    """`--int8-embedding` on a tied bf16 model (the LM head reads the int8 rows): CUDA graphs give
    eager's greedy tokens, and both the tokens of the model whose table holds the dequantized rows."""
    import shutil

    from gpu_utils import release, token_ids
    from safetensors.torch import load_file, save_file

    from llmserve import LLM, SamplingParams
    from llmserve.model.int8 import dequantize_int8, quantize_rows_int8
    from llmserve.model.random_model import make_random_model

    model = make_random_model(tmp_path / "m", "llama", vocab_size=4096, hidden_size=512, intermediate_size=1536,
                              num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                              tie_word_embeddings=True, max_position_embeddings=2048)  # fmt: skip
    twin = tmp_path / "twin"
    shutil.copytree(model, twin)
    tensors = load_file(str(twin / "model.safetensors"))
    tensors["model.embed_tokens.weight"] = dequantize_int8(*quantize_rows_int8(tensors["model.embed_tokens.weight"]))
    save_file(tensors, str(twin / "model.safetensors"))
    prompts = [{"prompt_token_ids": [(17 * i + 5 * j) % 4000 + 10 for j in range(12 + i)]} for i in range(12)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    runs = []
    for path, eager, embedding in ((model, True, True), (model, False, True), (twin, False, False)):
        llm = LLM(str(path), dtype="bfloat16", quantization="int8", int8_embedding=embedding, enforce_eager=eager,
                  max_model_len=256, kv_cache_memory_bytes=1 << 30)  # fmt: skip
        assert (llm.core.runner.model.model.embed_tokens.weight.dtype == torch.int8) == embedding
        runs.append(token_ids(llm.generate(prompts, params, use_tqdm=False)))
        llm.shutdown()
        del llm
        release()
    assert runs[0] == runs[1] == runs[2]
