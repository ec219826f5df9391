"""Which implementation of the batched LoRA ops the model's LoRA layers call: the PyTorch
references, or the Triton kernels with the same results (tested against them), with the
expand of steps of many tokens optionally as one cuBLAS GEMM (llmserve/lora/expand_gemm.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llmserve.lora.reference import lora_expand_reference, lora_shrink_reference


def _reference_expand(y, t, lora, batch) -> None:
    lora_expand_reference(y, t, lora.b, lora.slice_offsets, lora.max_slice_width, batch)


@dataclass(frozen=True, slots=True)
class LoRAOps:
    shrink: Callable = (
        lora_shrink_reference  # (x, a, scaling, batch) -> t [T, slices, max_rank] float32 (or splits of it)
    )
    expand: Callable = _reference_expand  # (y, t, lora: ProjectionLoRA, batch) -> None, y += in place
    # layer inputs of at most this many rows: the adapter on a second CUDA stream beside the base
    # GEMM (LoRALinear; CUDA only, 0: never), the delta of o_proj, gate_up_proj and down_proj then
    # added by the op after each, in its own kernel (llmserve/lora/deferred.py)
    overlap_max_tokens: int = 0


REFERENCE_LORA_OPS = LoRAOps()


# projections at least this wide expand as a GEMM (the MLP's gate/up: about twice as fast at 512
# tokens); q/k/v, o and down are slower as a GEMM
GEMM_EXPAND_MIN_WIDTH = 16384


def triton_lora_ops(gemm_expand_min_tokens: int = 0, gemm_expand_min_width: int = GEMM_EXPAND_MIN_WIDTH,
                    overlap_max_tokens: int = 0) -> LoRAOps:  # fmt: skip
    """The Triton kernels (needs the `triton` package; on a CPU they run under the interpreter).
    `gemm_expand_min_tokens` > 0: layer inputs of at least that many rows expand through
    `lora_expand_gemm` instead of the Triton expand (0: never), in projections with at least
    `gemm_expand_min_width` outputs (the MLP's gate/up: there the Triton expand re-reads its
    partial planes for every one of many output tiles)."""
    from llmserve.kernels.lora import lora_expand, lora_shrink
    from llmserve.lora.expand_gemm import lora_expand_gemm

    def expand(y, t, lora, batch) -> None:
        if 0 < gemm_expand_min_tokens <= y.shape[0] and y.shape[1] >= gemm_expand_min_width:
            lora_expand_gemm(y, t, lora.b_all, lora.slice_bounds, batch)
        else:
            lora_expand(y, t, lora.b, lora.slice_offsets, lora.max_slice_width, batch)

    if (
        gemm_expand_min_tokens > 0
    ):  # the overlapped expand writes a float32 buffer, which the GEMM form (in y's dtype) cannot take
        overlap_max_tokens = min(overlap_max_tokens, gemm_expand_min_tokens - 1)
    return LoRAOps(lora_shrink, expand, overlap_max_tokens)
