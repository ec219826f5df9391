"""Building blocks of the decoder block: RMSNorm, rotary embedding, the gated MLP's activations
(SiLU for Llama's SwiGLU, tanh GELU for Gemma's GeGLU).

Each is written to give the same float32 results as Hugging Face transformers'
implementation (same op order), because greedy equality with transformers is the
engine's correctness oracle. Fused GPU kernels live in `llmserve/kernels/` and are
checked against these.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model.arch import RopeConfig
from llmserve.model.fp8 import Fp8Tokens, fp8_gemm_reference, fp8_matmul_reference, quantized
from llmserve.model.gguf_linear import gguf_matmul_reference
from llmserve.model.int8 import int8_matmul_reference
from llmserve.model.moe import fused_moe_reference
from llmserve.model.w4a16 import w4a16_matmul_reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def qk_rms_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Each head of q [T, Hq, D] and of k [T, Hk, D] normalised over D, with its own weight (Qwen3's
    q_norm and k_norm): two `rms_norm`s (kernels/norm.py `qk_rms_norm` does both in one launch)."""
    return rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)


def add_delta(x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    """`x.add_(delta)` without writing x: a float32 LoRA delta added, rounded back to x's dtype
    (the `delta` of the ops below: a LoRA layer's, added by the op after it, llmserve/lora/deferred.py)."""
    return x if delta is None else (x.to(torch.float32) + delta).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    x = add_delta(x, delta) + residual
    return rms_norm(x, weight, eps), x


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Tokens:
    return quantized(rms_norm(x, weight, eps))


def fused_add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[Fp8Tokens, torch.Tensor]:
    out, x = fused_add_rms_norm(x, residual, weight, eps)
    return quantized(out), x


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hkv, D]; cos_sin: [2, max_pos, D] (neox-style halves)."""
    cos = cos_sin[0, positions].to(q.dtype)[:, None, :]
    sin = cos_sin[1, positions].to(q.dtype)[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def silu_and_mul(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    gate, up = add_delta(gate_up, delta).chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_fp8(gate_up: torch.Tensor) -> Fp8Tokens:
    return quantized(silu_and_mul(gate_up))


def gelu_tanh_and_mul(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """GeGLU's activation (transformers' `gelu_pytorch_tanh`): tanh-approximated GELU of the gate times up."""
    gate, up = add_delta(gate_up, delta).chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_and_mul_fp8(gate_up: torch.Tensor) -> Fp8Tokens:
    return quantized(gelu_tanh_and_mul(gate_up))


@dataclass(frozen=True)
class LayerOps:
    """The elementwise ops the model runs: these PyTorch references, or fused kernels
    with the same signatures (`llmserve.kernels`, tested against these)."""

    rms_norm: Callable = rms_norm
    fused_add_rms_norm: Callable = fused_add_rms_norm
    apply_rotary: Callable = apply_rotary
    silu_and_mul: Callable = silu_and_mul
    fp8_matmul: Callable = fp8_matmul_reference  # FP8 linear layers (model/fp8.py)
    fp8_gemm: Callable = fp8_gemm_reference  # ... on activations already quantized (Fp8Tokens)
    # the norms and the activation with their output quantized to FP8 per token (for FP8 layers)
    rms_norm_fp8: Callable = rms_norm_fp8
    fused_add_rms_norm_fp8: Callable = fused_add_rms_norm_fp8
    silu_and_mul_fp8: Callable = silu_and_mul_fp8
    linear: Callable = F.linear  # the 16-bit projections' product
    # GeGLU's activation (`ModelArch.hidden_act` "gelu_pytorch_tanh"), plain and quantized to FP8
    gelu_tanh_and_mul: Callable = gelu_tanh_and_mul
    gelu_tanh_and_mul_fp8: Callable = gelu_tanh_and_mul_fp8
    # a mixture of experts' routed experts: (x, router logits, w13, w2, top_k, renormalize) -> out
    fused_moe: Callable = fused_moe_reference
    int8_matmul: Callable = int8_matmul_reference  # INT8 (W8A8) linear layers (model/int8.py)
    w4a16_matmul: Callable = w4a16_matmul_reference  # GPTQ / AWQ 4-bit linear layers (model/w4a16.py)
    gguf_matmul: Callable = gguf_matmul_reference  # GGUF layers kept quantized (model/gguf_linear.py)
    qk_rms_norm: Callable = qk_rms_norm  # the q and k heads' norms of one layer (Qwen3, Gemma 3)


REFERENCE_OPS = LayerOps()


def triton_ops(fp8_fast_accum_tokens: int | None = None) -> LayerOps:
    """The fused kernels; FP8 GEMMs of steps of at least `fp8_fast_accum_tokens` tokens accumulate
    fast (None: the kernels' default, FAST_ACCUM_TOKENS; 0: never)."""
    from functools import partial

    from llmserve import kernels
    from llmserve.kernels.fp8_linear import FAST_ACCUM_TOKENS
    from llmserve.kernels.fused_moe import fused_moe
    from llmserve.kernels.gguf_linear import gguf_matmul_fast
    from llmserve.kernels.int8_linear import int8_matmul_fast
    from llmserve.kernels.w4a16_linear import w4a16_matmul_fast

    fast = FAST_ACCUM_TOKENS if fp8_fast_accum_tokens is None else fp8_fast_accum_tokens
    return LayerOps(kernels.rms_norm, kernels.fused_add_rms_norm, kernels.apply_rotary, kernels.silu_and_mul,
                    partial(kernels.fp8_matmul_fused_quant, fast_accum_tokens=fast),
                    partial(kernels.fp8_gemm_fast, fast_accum_tokens=fast), kernels.rms_norm_fp8,
                    kernels.fused_add_rms_norm_fp8, kernels.silu_and_mul_fp8, kernels.dense_linear,
                    gelu_tanh_and_mul=kernels.gelu_tanh_and_mul,
                    gelu_tanh_and_mul_fp8=kernels.gelu_tanh_and_mul_fp8, fused_moe=fused_moe, int8_matmul=int8_matmul_fast,
                    w4a16_matmul=w4a16_matmul_fast, gguf_matmul=gguf_matmul_fast,
                    qk_rms_norm=kernels.qk_rms_norm)  # fmt: skip


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: LayerOps = REFERENCE_OPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise `x`; with `residual`, first add it and also return the sum."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def fp8(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Fp8Tokens | tuple[Fp8Tokens, torch.Tensor]:
        """`forward`, the output quantized to FP8 per token (the input of an FP8 linear layer)."""
        if residual is None:
            return self.ops.rms_norm_fp8(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm_fp8(x, residual, self.weight, self.eps)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponent)
    if rope.freq_factors is not None:  # llama.cpp's form of a scaling (Llama 3.1 GGUFs)
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with a precomputed cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig, ops: LayerOps = REFERENCE_OPS) -> None:
        super().__init__()
        self.ops = ops
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.rope = rope
        self.register_buffer("cos_sin", self._table(), persistent=False)

    def _table(self) -> torch.Tensor:
        inv_freq = rope_inv_freq(self.head_dim, self.rope)
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return torch.stack((emb.cos(), emb.sin()))  # [2, P, D]

    def rebuild(self, device: torch.device) -> None:
        """Recompute the table (after the module was created on the meta device)."""
        self.cos_sin = self._table().to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D]; positions: [T]."""
        return self.ops.apply_rotary(q, k, positions, self.cos_sin)
