"""Triton-language GPU kernels, each with a plain PyTorch reference it is tested against.

| kernel | module | PyTorch reference |
| --- | --- | --- |
| `triton_paged_attention` (drop-in `AttentionBackend`, sliding `window=` too) | `paged_attention` | `llmserve.model.attention.reference_paged_attention` |
| `write_kv` (reshape-and-cache) | `cache_write` | `llmserve.model.attention.write_kv_cache` |
| `rms_norm`, `fused_add_rms_norm` (and `_fp8`: quantized to FP8 per token in the same pass); `qk_rms_norm` (a layer's q and k heads in one launch) | `norm` | `llmserve.model.layers.RMSNorm` (then `llmserve.model.fp8.quantize_tokens`), `layers.qk_rms_norm` |
| `apply_rotary` | `rotary` | `llmserve.model.layers.RotaryEmbedding` |
| `silu_and_mul`, `gelu_tanh_and_mul` (and `_fp8`) | `activation` | `llmserve.model.layers.silu_and_mul`, `gelu_tanh_and_mul` (then `quantize_tokens`) |
| `quantize_tokens_fp8` | `fp8_quant` | `llmserve.model.fp8.quantize_tokens` |
| `fp8_gemm_small_m`, `gemm_small_m` (split-K, few tokens, one launch; FP8 or 16-bit) | `split_k_gemm` | `llmserve.model.fp8.fp8_gemm_reference`, `F.linear` |
| `dense_linear` (which 16-bit GEMM for how many tokens) | `dense_linear` | `F.linear` |
| `fp8_gemm_fast`, `fp8_matmul_fused_quant` (which GEMM for how many tokens) | `fp8_linear` | `llmserve.model.fp8.fp8_gemm_reference`, `fp8_matmul_reference` |
| `int8_gemm_triton`, `int_mm` (CUDA's shape rules met by padding), `int8_matmul_fast` (W8A8: which GEMM for how many tokens; int32 sums, equal bit for bit; split-K at decode) | `int8_linear` | `llmserve.model.int8.int8_gemm_reference`, `int8_matmul_reference` |
| `w4a16_gemm_triton` (4-bit weights dequantized in registers; split-K at decode), `w4a16_matmul_fast` | `w4a16_linear` | `llmserve.model.w4a16.w4a16_matmul_reference` |
| `gguf_gemm_triton` (GGUF Q8_0, Q5_0, Q4_K, Q5_K, Q6_K blocks dequantized in registers, a kernel a format; split-K at decode), `gguf_matmul_fast` | `gguf_linear` | `llmserve.model.gguf_linear.gguf_matmul_reference` |
| `SplitKRule`, `split_k_count`, `plan_split`, `sum_slices` (the quantized GEMMs' split-K: the slice count by a tunable rule, a launch's slices and scratch, the slices' partials added in slice order in the same launch) | `quant_split_k` | each kernel unsplit (`split_k=1`) and its reference |
| `lora_shrink`, `lora_expand` (batched multi-LoRA, tokens grouped by adapter slot) | `lora` | `llmserve.lora.reference` |
| `fused_moe` (routing, tokens aligned by expert, gate/up and down grouped GEMMs, the sum; an expert-parallel rank's share) | `fused_moe` | `llmserve.model.moe.fused_moe_reference` |
| `apply_penalties_`, `race` (the sampler's penalties and plain exponential race, one pass over the vocabulary each) | `sampling` | `PenaltyState.apply_tensors`, `sampler_reference.exponential_race` |
| `filtered_race` (the race over each row's top-p / min-p set without a sort; seeded rows' hash noise inside) | `filtered_race` | `sampler_reference.apply_top_k_top_p_min_p` then `exponential_race` |
| `logprob_stats` (from the raw logits: the sampled token's logprob and rank and the top k logprobs, one pass) | `logprob_stats` | `log_softmax`, `(lp > token's).sum() + 1`, `torch.topk` |

Importing this package needs the `triton` package (not a GPU): on CPU the kernels run
under the Triton interpreter (`TRITON_INTERPRET=1` set before triton is imported), which
is how the tests check them; tests/test_kernel_compile.py also compiles the sampling kernels for
sm_90 on the CPU, which finds what only the compiler does. `has_triton_gpu()` says whether the
real GPU path is usable.
"""

from __future__ import annotations

import os


def has_triton_gpu() -> bool:
    """True when Triton kernels can run compiled on a CUDA GPU here (not the interpreter)."""
    try:
        import torch
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "no"
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return torch.cuda.is_available()


try:
    from llmserve.kernels.activation import gelu_tanh_and_mul, gelu_tanh_and_mul_fp8, silu_and_mul, silu_and_mul_fp8
    from llmserve.kernels.cache_write import write_kv
    from llmserve.kernels.dense_linear import dense_linear
    from llmserve.kernels.fp8_linear import fp8_gemm_fast, fp8_matmul_fused_quant
    from llmserve.kernels.fp8_quant import quantize_tokens_fp8
    from llmserve.kernels.lora import lora_expand, lora_shrink
    from llmserve.kernels.norm import fused_add_rms_norm, fused_add_rms_norm_fp8, qk_rms_norm, rms_norm, rms_norm_fp8
    from llmserve.kernels.paged_attention import (
        AttnLaunchConfig,
        choose_num_splits,
        paged_attention_forward,
        triton_paged_attention,
    )
    from llmserve.kernels.rotary import apply_rotary

    HAS_TRITON = True
except ImportError:  # triton not installed: the PyTorch references remain the only path
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "AttnLaunchConfig",
    "apply_rotary",
    "choose_num_splits",
    "dense_linear",
    "fp8_gemm_fast",
    "fp8_matmul_fused_quant",
    "fused_add_rms_norm",
    "fused_add_rms_norm_fp8",
    "gelu_tanh_and_mul",
    "gelu_tanh_and_mul_fp8",
    "has_triton_gpu",
    "lora_expand",
    "lora_shrink",
    "paged_attention_forward",
    "qk_rms_norm",
    "quantize_tokens_fp8",
    "rms_norm",
    "rms_norm_fp8",
    "silu_and_mul",
    "silu_and_mul_fp8",
    "triton_paged_attention",
    "write_kv",
]
