"""The sampling kernels (penalties, races, logprob statistics) and the fused MoE kernels compile for a
Hopper GPU (sm_90), on this CPU machine.

The interpreter (tests/test_kernels.py) runs the kernels' Python, not Triton's compiler, so an
error only the compiler finds (a variable of two types across a runtime `if`, a missing
libdevice function) would first show on the GPU. Here each kernel goes through Triton's whole
pipeline to a cubin for sm_90, in a process of its own without TRITON_INTERPRET."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
from sm90_compile import compile_script

pytestmark = pytest.mark.integration

# not imported here: tests/test_kernels.py needs triton first imported under TRITON_INTERPRET=1
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

SCRIPT = textwrap.dedent(
    """
    import itertools
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from llmserve.kernels.filtered_race import FILTER_BLOCK, _filtered_race_kernel
    from llmserve.kernels.logprob_stats import STATS_BLOCK, _stats_kernel
    from llmserve.kernels.sampling import PENALTY_BLOCK, RACE_BLOCK, _penalties_kernel, _race_kernel

    target = GPUTarget("cuda", 90, 32)

    def build(kernel, signature, constants):
        signature = dict(signature, **{name: "constexpr" for name in constants})
        triton.compile(ASTSource(kernel, signature, constants), target=target)
        print("compiled", kernel.__name__, constants, flush=True)

    filtered = dict(logits_ptr="*fp32", rows_ptr="*i64", temp_ptr="*fp32", top_p_ptr="*fp32", min_p_ptr="*fp32",
                    slot_ptr="*i32", keys_ptr="*i64", noise_ptr="*fp32", seed_ptr="*i64", out_ptr="*i64",
                    stride_l="i32", stride_n="i32", vocab="i32")
    # every (row list, temperatures, seeds) variant the warm-up compiles, and one with test noise
    for flags in [(*f, False) for f in itertools.product((False, True), repeat=3)] + [(True, False, True, True)]:
        build(_filtered_race_kernel, filtered, dict(BLOCK=FILTER_BLOCK, HAS_ROWS=flags[0], HAS_TEMP=flags[1],
              HAS_KEYS=flags[2], HAS_NOISE=flags[3], LIBDEVICE=True))
    race = dict(logits_ptr="*fp32", rows_ptr="*i64", temp_ptr="*fp32", noise_ptr="*fp32", seed_ptr="*i64",
                best_ptr="*fp32", where_ptr="*i32", stride_l="i32", stride_n="i32", vocab="i32")
    build(_race_kernel, race, dict(BLOCK=RACE_BLOCK, HAS_ROWS=True, HAS_TEMP=True, HAS_NOISE=False))
    penalties = dict(logits_ptr="*fp32", counts_ptr="*i32", seen_ptr="*u8", rows_ptr="*i64", slots_ptr="*i64",
                     rep_ptr="*fp32", presence_ptr="*fp32", frequency_ptr="*fp32", stride_l="i32", stride_c="i32",
                     stride_s="i32", vocab="i32")
    build(_penalties_kernel, penalties, dict(BLOCK=PENALTY_BLOCK, HAS_REP=True, HAS_SEEN=True, HAS_ADD=True))
    for logits, has_rows in (("*bf16", False), ("*fp32", True)):
        stats = dict(x_ptr=logits, rows_ptr="*i64", tok_ptr="*i64", count_ptr="*i32", max_ptr="*fp32", sum_ptr="*fp32",
                     top_v_ptr="*fp32", top_i_ptr="*i32", stride="i32", vocab="i32")
        build(_stats_kernel, stats, dict(BLOCK=STATS_BLOCK, K=8, HAS_ROWS=has_rows))
    """
)


def test_sampling_kernels_compile_for_sm90(tmp_path):
    assert compile_script(SCRIPT, tmp_path).count("compiled") == 13
    assert list(tmp_path.rglob("*.cubin"))


MOE_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from llmserve.kernels import fused_moe as fm

    target = GPUTarget("cuda", 90, 32)

    def build(kernel, signature, constants):
        signature = dict(signature, **{name: "constexpr" for name in constants})
        triton.compile(ASTSource(kernel, signature, constants), target=target)
        print("compiled", kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__, flush=True)

    strides = dict(stride_we="i64", stride_wn="i32", stride_se="i32", stride_sn="i32", stride_sk="i32")
    tiles = fm.DEFAULT_TILES[32]
    dec = fm.DEFAULT_DECODE
    # (activation dtype, weight dtype, scales mode, scale block)
    for act, wt, mode, (sn, sk) in (("*bf16", "*bf16", fm.NO_SCALES, (1, 1)),
                                    ("*bf16", "*fp8e4nv", fm.BLOCK_SCALES, (128, 128))):  # (the per-channel path: a subset)
        scale = dict(SCALES=mode, SCALE_N=sn, SCALE_K=sk)
        x = "*fp8e4nv" if mode != fm.NO_SCALES else act
        build(fm._gate_up_kernel, dict(x_ptr=x, w_ptr=wt, out_ptr="*bf16", sorted_ptr="*i32", block_expert_ptr="*i32",
              num_padded_ptr="*i32", sx_ptr="*fp32", sw_ptr="*fp32", N="i32", H="i32", I="i32", stride_xm="i32",
              stride_om="i32", **strides), dict(TOP_K=8, BLOCK_M=tiles["BLOCK_M"], BLOCK_N=tiles["BLOCK_N"],
              BLOCK_K=tiles["BLOCK_K"], DOT_PREC="tf32", **scale))
        build(fm._down_kernel, dict(a_ptr=x, w_ptr=wt, weights_ptr="*fp32", out_ptr="*bf16", sorted_ptr="*i32",
              block_expert_ptr="*i32", num_padded_ptr="*i32", sa_ptr="*fp32", sw_ptr="*fp32", N="i32", H="i32", I="i32",
              stride_am="i32", stride_om="i32", **strides), dict(BLOCK_M=tiles["BLOCK_M"], BLOCK_N=tiles["BLOCK_N"],
              BLOCK_K=tiles["BLOCK_K"], DOT_PREC="tf32", **scale))
        build(fm._gate_up_decode_kernel, dict(x_ptr=x, w_ptr=wt, out_ptr="*bf16", ids_ptr="*i32", sx_ptr="*fp32",
              sw_ptr="*fp32", H="i32", I="i32", stride_xm="i32", stride_om="i32", **strides),
              dict(TOP_K=8, BLOCK_N=dec["BLOCK_N"], BLOCK_K=dec["BLOCK_K"], **scale))
        build(fm._down_decode_kernel, dict(a_ptr=x, w_ptr=wt, weights_ptr="*fp32", ids_ptr="*i32", out_ptr="*bf16",
              sa_ptr="*fp32", sw_ptr="*fp32", H="i32", I="i32", stride_am="i32", stride_o="i32", **strides),
              dict(TOP_K=8, BLOCK_N=dec["DOWN_BLOCK_N"], BLOCK_K=dec["BLOCK_K"], **scale))
    build(fm._route_kernel, dict(logits_ptr="*bf16", weights_ptr="*fp32", ids_ptr="*i32", E="i32", stride_l="i32"),
          dict(TOP_K=8, BLOCK_E=128, BLOCK_TOPK=8, RENORMALIZE=True))
    build(fm._align_kernel, dict(ids_ptr="*i32", sorted_ptr="*i32", block_expert_ptr="*i32", num_padded_ptr="*i32",
          N="i32", E="i32", MAX_BLOCKS="i32"), dict(BLOCK_M=16, BLOCK_E=128, CHUNK=64, BLOCK_B=64))
    build(fm._reduce_kernel, dict(rows_ptr="*bf16", out_ptr="*bf16", H="i32", stride_r="i32", stride_o="i32"),
          dict(TOP_K=8, BLOCK_H=1024))
    """
)


def test_fused_moe_kernels_compile_for_sm90(tmp_path):
    """The fused MoE kernels, grouped and decode, 16-bit and FP8 (per block), and the
    route / align / reduce steps: a global the compiler refuses (as once happened) fails here."""
    assert compile_script(MOE_SCRIPT, tmp_path, timeout=600).count("compiled") == 11
    assert list(tmp_path.rglob("*.cubin"))


NORM_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from llmserve.kernels import norm

    target = GPUTarget("cuda", 90, 32)
    for dtype in ("*bf16", "*fp16"):
        signature = dict(q_ptr=dtype, k_ptr=dtype, qw_ptr=dtype, kw_ptr=dtype, out_ptr=dtype, stride_qt="i32",
                         stride_qh="i32", stride_kt="i32", stride_kh="i32", n_q="i32", n_heads="i32", n_cols="i32",
                         eps="fp32", BLOCK="constexpr", USE_GDC="constexpr")
        triton.compile(ASTSource(norm._qk_rms_norm_kernel, signature, dict(BLOCK=128, USE_GDC=False)), target=target)
        print("compiled", dtype, flush=True)
    """
)


def test_qk_norm_kernel_compiles_for_sm90(tmp_path):
    """The q/k head norms' kernel (a runtime branch on the head picks q's or k's row and weight)."""
    assert compile_script(NORM_SCRIPT, tmp_path).count("compiled") == 2
    assert list(tmp_path.rglob("*.cubin"))
