"""Split-K at decode for the quantized GEMMs (llmserve/kernels/quant_split_k.py): the rule that picks
the slice count, and each kernel split along K under the Triton interpreter against its reference
and against itself unsplit — INT8 bit for bit (int32 sums), W4A16 and GGUF within float32
rounding (the slices' float32 partials are added in another order than one loop's) and the
same on every run. Also: the split kernels compile for a Hopper GPU (sm_90) here. Shapes are
tiny: the interpreter runs every program in Python."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton or llmserve.kernels is imported

import json  # noqa: E402
import textwrap  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sm90_compile import compile_script  # noqa: E402

triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

if not isinstance(triton.language.standard.cdiv, InterpretedFunction):
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; run this file in its own process",
                allow_module_level=True)  # fmt: skip

import numpy as np  # noqa: E402

from llmserve.kernels import int8_linear, quant_split_k, tuning  # noqa: E402
from llmserve.kernels.gguf_linear import gguf_gemm_triton  # noqa: E402
from llmserve.kernels.int8_linear import int8_gemm_triton  # noqa: E402
from llmserve.kernels.quant_split_k import SplitKRule, slice_steps, split_k_count  # noqa: E402
from llmserve.kernels.w4a16_linear import w4a16_gemm_triton  # noqa: E402
from llmserve.model.gguf.dequant import dequantize  # noqa: E402
from llmserve.model.gguf.quantize import quantize  # noqa: E402
from llmserve.model.gguf_linear import GGUFBlocks  # noqa: E402
from llmserve.model.int8 import int8_gemm_reference, quantize_rows_int8, quantize_tokens_int8  # noqa: E402
from llmserve.model.w4a16 import pack_rows, w4a16_matmul_reference  # noqa: E402
from llmserve.model.w4a16_checkpoint import quantize_groups  # noqa: E402

pytestmark = pytest.mark.unit


def test_the_rule_splits_only_few_tokens_and_never_past_k():
    rule = SplitKRule(max_rows=16, programs=256)
    assert split_k_count(rule, 1, 32, 64) == 4  # 4,096 x 4,096 in 64-wide tiles, 128-deep steps
    assert split_k_count(rule, 16, 112, 64) == 4
    assert split_k_count(rule, 17, 112, 64) == 1  # past max_rows: the kernel unsplit
    assert split_k_count(rule, 1, 2, 8) == 2  # never more slices than K steps
    assert split_k_count(rule, 1, 32, 512) == 1  # tiles enough already
    assert split_k_count(SplitKRule(0, 256), 1, 32, 8) == 1  # max_rows 0: never
    assert split_k_count(rule, 1, 32, 64, gpu=False) == 1  # the interpreter: no SMs to fill
    # slices of equal steps, none empty: 10 steps asked in 4 -> 3, 3, 3, 1; in 6 -> 2 x 5
    assert slice_steps(10, 4) == (3, 4) and slice_steps(10, 6) == (2, 5) and slice_steps(3, 8) == (1, 3)
    assert slice_steps(0, 4) == (0, 1)


def test_the_rules_are_tunable_settings(tmp_path, monkeypatch):
    """A card's settings file (`llmserve tune`'s table) holds a rule as an object of its fields."""
    monkeypatch.setenv("LLMSERVE_TUNED_DIR", str(tmp_path))
    module = "llmserve.kernels.int8_linear"
    try:
        tuning.write_settings("cpu", {module: {"SPLIT_K_RULE": SplitKRule(max_rows=4, programs=128)}}, "test")
        assert tuning.apply("cpu").changed == {module: {"SPLIT_K_RULE": SplitKRule(4, 128)}}
        assert int8_linear.SPLIT_K_RULE == SplitKRule(4, 128)
        (tmp_path / "cpu.json").write_text(json.dumps({"settings": {module: {"SPLIT_K_RULE": {"max_rows": 4}}}}))
        with pytest.raises(ValueError, match="max_rows, programs"):
            tuning.apply("cpu")
    finally:
        tuning.set_values({})
    assert int8_linear.SPLIT_K_RULE == tuning.defaults()[module]["SPLIT_K_RULE"]


def test_llmserve_tune_searches_the_rules_on_checked_calls(monkeypatch):
    """`llmserve tune`'s INT8 and W4A16 workloads (the kernels against their references) and the
    search over the rules; tiny shapes, one token count, two candidates (on the interpreter the
    kernels do not split, so the timer here decides: it prefers the second candidate)."""
    from llmserve.kernels import tune, w4a16_linear

    monkeypatch.setattr(tune, "QUANT_TOKENS", (2,))
    cpu = torch.device("cpu")
    workloads = {"int8": tune.int8_workload([(24, 64)], cpu), "w4a16": tune.w4a16_workload([(16, 64)], cpu, 32)}
    assert [name for name, _, _ in workloads["int8"]] == ["int8 24x64 m=2"]
    wanted = SplitKRule(4, 512)
    settings = [tune.Setting(f"llmserve.kernels.{module}", "SPLIT_K_RULE", (SplitKRule(0, 256), wanted), workload)
                for module, workload in (("int8_linear", "int8"), ("w4a16_linear", "w4a16"))]  # fmt: skip

    def timer(fn):
        fn()
        return 2.0 - (int8_linear.SPLIT_K_RULE == wanted) - (w4a16_linear.SPLIT_K_RULE == wanted)

    chosen = tune.search(workloads, timer, settings, progress=lambda _: None)
    assert chosen == {"llmserve.kernels.int8_linear": {"SPLIT_K_RULE": wanted},
                      "llmserve.kernels.w4a16_linear": {"SPLIT_K_RULE": wanted}}  # fmt: skip
    assert int8_linear.SPLIT_K_RULE == tuning.defaults()["llmserve.kernels.int8_linear"]["SPLIT_K_RULE"]
    assert all(s.candidates == tune.SPLIT_K_RULES for s in tune.SEARCH if s.name == "SPLIT_K_RULE")


def _int8_operands(m: int, k: int, n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    xq, sx = quantize_tokens_int8(torch.randn(m, k, generator=gen) * 4)
    wq, sw = quantize_rows_int8(torch.randn(n, k, generator=gen) * 0.05)
    return xq, sx, wq, sw


@pytest.mark.parametrize(("m", "k", "n", "split_k"), [(1, 160, 40, 3), (5, 256, 70, 8), (16, 96, 32, None)])
def test_int8_split_k_equals_the_reference_bit_for_bit(m, k, n, split_k):
    """K 160 in 32-deep steps split 3 ways: slices of 2, 2 and 1 steps, the last step masked."""
    xq, sx, wq, sw = _int8_operands(m, k, n, seed=m + k)
    for out_dtype in (torch.float32, torch.bfloat16):
        want = int8_gemm_reference(xq, sx, wq, sw, out_dtype)
        got = int8_gemm_triton(xq, sx, wq, sw, out_dtype, block_n=32, block_k=32, split_k=split_k)
        assert got.dtype == out_dtype and torch.equal(got, want)
        assert torch.equal(int8_gemm_triton(xq, sx, wq, sw, out_dtype, block_n=32, block_k=32, split_k=1), want)
    assert not quant_split_k.counters(xq.device).any()  # every tile's counter zero again


@pytest.mark.parametrize(("m", "k", "n", "group", "act_order", "split_k"),
                         [(1, 128, 40, 32, False, 3), (4, 192, 24, 64, True, 5)])  # fmt: skip
def test_w4a16_split_k_equals_the_reference(m, k, n, group, act_order, split_k):
    """16-deep K steps in 3 (5) slices: slice edges inside groups (and act-order's scattered ones)."""
    gen = torch.Generator().manual_seed(m + k)
    q, scales, zeros, g_idx = quantize_groups(torch.randn(n, k, generator=gen) * 0.05, group, False, act_order)
    qweight, scales = pack_rows(q), scales.to(torch.float16)
    x = torch.randn(m, k, generator=gen)
    want = w4a16_matmul_reference(x, qweight, scales, zeros, g_idx)
    got = w4a16_gemm_triton(x, qweight, scales, zeros, g_idx, block_n=16, block_k=16, split_k=split_k)
    unsplit = w4a16_gemm_triton(x, qweight, scales, zeros, g_idx, block_n=16, block_k=16, split_k=1)
    # float32: the same products; the slices' sums added in another order than one loop's
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, unsplit, rtol=1e-6, atol=1e-6)
    assert torch.equal(
        got, w4a16_gemm_triton(x, qweight, scales, zeros, g_idx, block_n=16, block_k=16, split_k=split_k)
    )  # fmt: skip  (the same on every run)
    bf16 = x.to(torch.bfloat16)  # bfloat16 activations: x's dtype out, as unsplit
    got16 = w4a16_gemm_triton(bf16, qweight, scales, zeros, g_idx, block_n=16, block_k=16, split_k=split_k)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16, w4a16_matmul_reference(bf16, qweight, scales, zeros, g_idx), rtol=2e-2, atol=2e-2)
    assert not quant_split_k.counters(x.device).any()


@pytest.mark.parametrize(("type_name", "split_k"), [("Q8_0", 3), ("Q4_K", 2), ("Q6_K", 2)])
def test_gguf_split_k_equals_dequantize_then_matmul(type_name, split_k):
    """K 512: Q8_0's 16 blocks in 3 slices (6, 6, 4), the K-quants' 2 super-blocks in 2; the output
    a column slice of a wider tensor (its row stride), as a layer of several pieces writes it."""
    rows, k, m = 24, 512, 3
    gen = torch.Generator().manual_seed(7)
    raw = torch.from_numpy(quantize(torch.randn(rows, k, generator=gen).numpy(), type_name).view(np.uint8)
                           .reshape(rows, -1).copy())  # fmt: skip
    piece = GGUFBlocks(type_name, rows, k)
    piece.load_raw(raw)
    x = torch.randn(m, k, generator=gen)
    want = x @ dequantize(raw, type_name, (rows, k)).t()
    wide = torch.full((m, rows + 8), 7.0)
    got = gguf_gemm_triton(x, type_name, piece.fields(), wide[:, 4 : 4 + rows], block_n=16, split_k=split_k)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert (wide[:, :4] == 7).all() and (wide[:, -4:] == 7).all()  # nothing written beside the slice
    unsplit = gguf_gemm_triton(x, type_name, piece.fields(), block_n=16, split_k=1)
    torch.testing.assert_close(got, unsplit, rtol=1e-6, atol=1e-5)
    assert not quant_split_k.counters(x.device).any()


COMPILE = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from llmserve.kernels.gguf_linear import _q6_k_kernel, _q8_0_kernel
    from llmserve.kernels.int8_linear import _int8_gemm_kernel
    from llmserve.kernels.w4a16_linear import _w4a16_gemm_kernel

    target = GPUTarget("cuda", 90, 32)

    def build(kernel, signature, constants):
        triton.compile(ASTSource(kernel, dict(signature, **{c: "constexpr" for c in constants}), constants),
                       target=target)
        print("compiled", kernel.__name__, constants, flush=True)

    int8 = dict(x_ptr="*i8", w_ptr="*i8", sx_ptr="*fp32", sw_ptr="*fp32", out_ptr="*bf16", part_ptr="*i32",
                count_ptr="*i32", M="i32", N="i32", K="i32", k_per_split="i32", stride_xm="i32", stride_wn="i32",
                stride_om="i32")
    build(_int8_gemm_kernel, int8, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=4))
    w4 = dict(x_ptr="*bf16", qw_ptr="*i32", s_ptr="*fp16", z_ptr="*u8", g_ptr="*i32", out_ptr="*bf16",
              part_ptr="*fp32", count_ptr="*i32", M="i32", N="i32", K="i32", k_per_split="i32", stride_xm="i32",
              stride_qn="i32", stride_sn="i32", stride_om="i32")
    build(_w4a16_gemm_kernel, w4, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, DOT_F32=False, SPLIT_K=4))
    head = dict(out_ptr="*bf16", part_ptr="*fp32", count_ptr="*i32", M="i32", N="i32", K="i32", steps="i32",
                stride_xm="i32")
    q8 = dict(x_ptr="*bf16", qs_ptr="*i8", d_ptr="*fp16", **head, stride_qs="i32", stride_d="i32", stride_om="i32")
    build(_q8_0_kernel, q8, dict(BLOCK_M=16, BLOCK_N=64, DOT_F32=False, SPLIT_K=4))
    q6 = dict(x_ptr="*bf16", ql_ptr="*u8", qh_ptr="*u8", sc_ptr="*i8", d_ptr="*fp16", **head, stride_ql="i32",
              stride_qh="i32", stride_sc="i32", stride_d="i32", stride_om="i32")
    build(_q6_k_kernel, q6, dict(BLOCK_M=16, BLOCK_N=64, DOT_F32=False, SPLIT_K=4))
    """
)


@pytest.mark.integration
def test_the_split_k_kernels_compile_for_sm90(tmp_path):
    assert compile_script(COMPILE, tmp_path).count("compiled") == 4 and list(tmp_path.rglob("*.cubin"))
