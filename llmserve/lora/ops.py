"""Which implementation of the batched LoRA ops the model's LoRA layers call: the PyTorch
references, or the Triton kernels with the same signatures (tested against them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llmserve.lora.reference import lora_expand_reference, lora_shrink_reference


@dataclass(frozen=True, slots=True)
class LoRAOps:
    shrink: Callable = lora_shrink_reference  # (x, a, scaling, batch) -> t [T, slices, max_rank] float32
    expand: Callable = lora_expand_reference  # (y, t, b, slice_offsets, max_slice_width, batch) -> None


REFERENCE_LORA_OPS = LoRAOps()


def triton_lora_ops() -> LoRAOps:
    """The Triton kernels (needs the `triton` package; on a CPU they run under the interpreter)."""
    from llmserve.kernels.lora import lora_expand, lora_shrink

    return LoRAOps(lora_shrink, lora_expand)
