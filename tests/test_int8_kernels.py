"""The INT8 GEMMs (llmserve/kernels/int8_linear.py) against the exact integer reference, on CPU:
the Triton kernel under the Triton interpreter, `torch._int_mm` (and its CUDA-rule padding: M >
16, K and N multiples of 8), bit for bit, since int32 sums are exact in any order and every
path applies the same epilogue. Also: the kernel compiles for a Hopper GPU (sm_90) here."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton or llmserve.kernels is imported

import textwrap  # noqa: E402
from functools import partial  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sm90_compile import compile_script  # noqa: E402

triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

if not isinstance(triton.language.standard.cdiv, InterpretedFunction):
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; run this file in its own process",
                allow_module_level=True)  # fmt: skip

from llmserve.kernels.int8_linear import (  # noqa: E402
    int8_gemm_fast,
    int8_gemm_int_mm,
    int8_gemm_triton,
    int_mm,
)
from llmserve.model.int8 import (  # noqa: E402
    int8_gemm_reference,
    int8_matmul_reference,
    quantize_rows_int8,
    quantize_tokens_int8,
)

pytestmark = pytest.mark.unit


def _operands(m: int, k: int, n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * 4
    xq, sx = quantize_tokens_int8(x)
    wq, sw = quantize_rows_int8(torch.randn(n, k, generator=gen) * 0.05)
    return xq, sx, wq, sw


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 96), (5, 72, 100), (16, 128, 64), (37, 200, 40), (70, 256, 130)])
def test_the_triton_kernel_equals_the_reference_exactly(m, k, n, out_dtype):
    xq, sx, wq, sw = _operands(m, k, n, seed=m + k)
    want = int8_gemm_reference(xq, sx, wq, sw, out_dtype)
    got = int8_gemm_triton(xq, sx, wq, sw, out_dtype)
    assert got.dtype == out_dtype and torch.equal(got, want)
    # smaller K steps and N tiles: more iterations and masked edges, the same sums
    assert torch.equal(int8_gemm_triton(xq, sx, wq, sw, out_dtype, block_n=32, block_k=32), want)


def test_the_kernel_accumulates_in_int32_without_overflow_or_rounding():
    """Every product at +-127^2 over K = 4,096: 66 million, past float32's exact integers (2^24)
    and far past int16, still exact in int32 (the reference sums in float64)."""
    k = 4096
    xq = torch.full((3, k), 127, dtype=torch.int8)
    xq[1] = -127
    xq[2, ::2] = -127
    wq = torch.full((8, k), 127, dtype=torch.int8)
    wq[3, 1] = 126  # one unit off: visible only if the sum is exact
    ones = torch.ones(3, 1), torch.ones(8, 1)
    want = int8_gemm_reference(xq, ones[0], wq, ones[1], torch.float32)
    assert want[0, 0] == 127 * 127 * k and want[2, 0] == 0 and want[2, 3] == -127  # (exact in float32: these are)
    assert torch.equal(int8_gemm_triton(xq, ones[0], wq, ones[1], torch.float32, block_k=512), want)
    assert torch.equal(int8_gemm_int_mm(xq, ones[0], wq, ones[1], torch.float32), want)
    acc = int_mm(xq, wq.t())
    assert acc.dtype == torch.int32 and acc[0, 3] == 127 * 127 * (k - 1) + 127 * 126


@pytest.mark.parametrize(("m", "k", "n"), [(1, 60, 5), (16, 64, 96), (17, 63, 97), (40, 256, 512)])
def test_int_mm_with_cuda_rules_pads_and_equals_the_reference(m, k, n):
    """`torch._int_mm` on CUDA needs M > 16 and K, N multiples of 8: the wrapper pads with zeros
    (checked here with the CPU's `_int_mm` under the same padding) and cuts the result back."""
    xq, sx, wq, sw = _operands(m, k, n, seed=m * n)
    want = int8_gemm_reference(xq, sx, wq, sw, torch.float32)
    assert torch.equal(int8_gemm_int_mm(xq, sx, wq, sw, torch.float32, cuda_rules=True), want)
    assert torch.equal(int8_gemm_int_mm(xq, sx, wq, sw, torch.float32, cuda_rules=False), want)
    assert int_mm(xq, wq.t(), cuda_rules=True).shape == (m, n)


def test_the_gpu_paths_pieces_compose_to_the_reference():
    """What `int8_matmul_fast` runs on a GPU (per-token quantization, then the Triton kernel up to
    16 tokens or `_int_mm` past them) against `int8_matmul_reference`, on bfloat16 activations,
    dynamic and static."""
    gen = torch.Generator().manual_seed(3)
    wq, sw = quantize_rows_int8(torch.randn(48, 96, generator=gen))
    for tokens in (7, 40):
        x = (torch.randn(tokens, 96, generator=gen) * 2).to(torch.bfloat16)
        for static in (None, torch.tensor(0.03)):
            want = int8_matmul_reference(x, wq, sw, static)
            xq, sx = quantize_tokens_int8(x, static)
            gemm = int8_gemm_triton if tokens <= 16 else partial(int8_gemm_int_mm, cuda_rules=True)
            assert want.dtype == torch.bfloat16 and torch.equal(gemm(xq, sx, wq, sw, x.dtype), want)
    xq, sx = quantize_tokens_int8(x)  # off a GPU the fast path is the reference itself
    assert torch.equal(
        int8_gemm_fast(xq, sx, wq, sw, torch.float32), int8_gemm_reference(xq, sx, wq, sw, torch.float32)
    )


COMPILE = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from llmserve.kernels.int8_linear import _int8_gemm_kernel

    sig = dict(x_ptr="*i8", w_ptr="*i8", sx_ptr="*fp32", sw_ptr="*fp32", out_ptr="*bf16", part_ptr="*i32",
               count_ptr="*i32", M="i32", N="i32", K="i32", k_per_split="i32", stride_xm="i32", stride_wn="i32",
               stride_om="i32")
    for bm in (16, 64):  # (split along K: tests/test_quant_split_k.py)
        consts = dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1)
        triton.compile(ASTSource(_int8_gemm_kernel, dict(sig, **{c: "constexpr" for c in consts}), consts),
                       target=GPUTarget("cuda", 90, 32))
        print("compiled", bm, flush=True)
    """
)


@pytest.mark.integration
def test_the_int8_kernel_compiles_for_sm90(tmp_path):
    assert compile_script(COMPILE, tmp_path).count("compiled") == 2 and list(tmp_path.rglob("*.cubin"))
