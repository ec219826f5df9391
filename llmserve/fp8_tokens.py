"""Activations already quantized to FP8 per token: what a fused kernel (RMSNorm, SiLU-and-
multiply) hands the FP8 linear layer after it, so the layer skips its own quantization.

Shared by `llmserve.kernels` (which make them) and `llmserve.model` (which consumes them);
kernels import nothing from the model, so the type lives beside both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Tokens:
    q: torch.Tensor  # [T, K] float8_e4m3fn
    scale: torch.Tensor  # [T, 1] float32, one per token
    dtype: torch.dtype  # the activations' dtype before quantization: the next layer's output dtype
