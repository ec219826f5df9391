"""FP8 (E4M3) linear layers: weights stored in FP8 with a scale per output channel,
activations quantized per token as they arrive.

y = (x_q * s_x) @ (W_q * s_w)^T, with x_q = x / s_x and W_q = W / s_w rounded to float8_e4m3fn
(s = amax / 448 per token, per output row). Two implementations of the product:
- `fp8_matmul_reference`: dequantize both to float32 and multiply (the plain definition);
- `fp8_matmul_scaled_mm`: `torch._scaled_mm` on the FP8 operands with row-wise scales
  (cuBLASLt on a GPU; exact against the reference on a CPU).
The model picks one through `LayerOps.fp8_matmul` (the reference with the PyTorch ops, the
fast one with the fused kernels). The LM head and the embedding stay in the model's dtype.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.fp8_tokens import Fp8Tokens
from llmserve.model.tensor_parallel import TPGroup

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_MIN_SCALE = 1e-12  # an all-zero row or token keeps a finite scale

# `--quantization`'s values: FP8 here, INT8 W8A8 in model/int8.py (4-bit checkpoints name their own)
QUANTIZATION_METHODS = ("fp8", "int8")


def quantize_rows(w: torch.Tensor, per_channel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` [rows, cols] in FP8 with a float32 scale per row ([rows, 1]); `per_channel=False`:
    one scale for the whole tensor (repeated per row, so both read alike)."""
    w = w.to(torch.float32)
    amax = w.abs().amax(dim=-1, keepdim=True) if per_channel else w.abs().amax().expand(w.shape[0], 1)
    scale = (amax / FP8_MAX).clamp(min=_MIN_SCALE)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.contiguous()


def quantize_tokens(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [T, K] in FP8, dynamically per token (or with a checkpoint's static scale)."""
    x = x.to(torch.float32)
    if static_scale is None:
        amax = x.abs().amax(dim=-1, keepdim=True)
        # a tensor divisor: torch on CUDA divides by a Python number as a multiply by its
        # reciprocal, which rounds some scales one ulp away from the kernels' true division
        scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=_MIN_SCALE)
    else:
        scale = static_scale.to(torch.float32).reshape(1, 1).expand(x.shape[0], 1)
    # times the scale's reciprocal (correctly rounded), as the kernels do: a division of every value
    # was their bottleneck at prefill sizes (llmserve/kernels/fp8_quant.py)
    inv = torch.ones_like(scale) / scale
    return (x * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.contiguous()


def fp8_gemm_reference(xq: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """FP8 tokens [T, K] with scales [T, 1] @ (FP8 weight [N, K] * scale [N, 1])^T: both
    dequantized, multiplied in float32, returned in `out_dtype`."""
    return ((xq.to(torch.float32) * sx) @ (weight.to(torch.float32) * weight_scale).t()).to(out_dtype)


def fp8_matmul_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         input_scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x [T, K] (any float dtype) @ (FP8 weight [N, K] * scale [N, 1])^T, the activations
    quantized as the fast path quantizes them; computed in float32, returned in x's dtype."""
    xq, sx = quantize_tokens(x, input_scale)
    return fp8_gemm_reference(xq, sx, weight, weight_scale, x.dtype)


def quantized(x: torch.Tensor) -> Fp8Tokens:
    """x [..., K] as FP8 tokens [T, K] (the reference of the fused norm and activation kernels)."""
    return Fp8Tokens(*quantize_tokens(x.reshape(-1, x.shape[-1])), x.dtype)


def fp8_matmul_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         input_scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The same product by `torch._scaled_mm` (FP8 operands, row-wise scales)."""
    xq, sx = quantize_tokens(x, input_scale)
    return fp8_gemm_scaled_mm(xq, sx, weight, weight_scale, x.dtype)


def fp8_gemm_scaled_mm(xq: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """`fp8_gemm_reference` by `torch._scaled_mm` (cuBLASLt on a GPU)."""
    return torch._scaled_mm(xq, weight.t(), scale_a=sx, scale_b=weight_scale.t(), out_dtype=out_dtype)


class Fp8Linear(nn.Module):
    """A linear layer with FP8 weights: column-parallel or plain (`tp` None), or row-parallel
    (`tp` given: the input is this rank's slice, the outputs are summed over ranks). Its input
    is activations in a float dtype, or `Fp8Tokens` already quantized by the kernel before it
    (only when the layer has no static input scale: `takes_fp8_tokens`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, matmul=fp8_matmul_reference,
                 tp: TPGroup | None = None, gemm=fp8_gemm_reference) -> None:  # fmt: skip
        super().__init__()
        self.matmul = matmul
        self.gemm = gemm
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, 1, dtype=torch.float32), requires_grad=False)
        self.input_scale: nn.Parameter | None = None  # a checkpoint's static activation scale
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @property
    def takes_fp8_tokens(self) -> bool:
        return self.input_scale is None

    def forward(self, x: torch.Tensor | Fp8Tokens) -> torch.Tensor:
        if isinstance(x, Fp8Tokens):
            y = self.gemm(x.q, x.scale, self.weight, self.weight_scale, x.dtype)
        else:
            shape = x.shape
            y = self.matmul(x.reshape(-1, shape[-1]), self.weight, self.weight_scale, self.input_scale)
            y = y.reshape(*shape[:-1], y.shape[-1])
        if self.tp is not None and self.tp.world_size > 1:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class DenseLinear(nn.Linear):
    """`nn.Linear` whose product is `linear` (`F.linear`, or the fast path of
    llmserve/kernels/dense_linear.py: a split-K kernel for few tokens)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, linear=F.linear) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.weight, self.bias)


def make_linear(in_features: int, out_features: int, bias: bool, quantization: str | None, matmul,
                tp: TPGroup | None = None, gemm=fp8_gemm_reference, linear=F.linear, ops=None) -> nn.Module:  # fmt: skip
    """The model's projections: a plain (or row-parallel, with `tp`) linear layer, or its FP8 form,
    or its INT8 form (`ops.int8_matmul`'s product, model/int8.py), or a GPTQ / AWQ checkpoint's
    4-bit form (`ops.w4a16_matmul`'s, model/w4a16.py)."""
    if quantization == "fp8":
        return Fp8Linear(in_features, out_features, bias, matmul, tp, gemm)
    if quantization == "int8":
        from llmserve.model.int8 import Int8Linear, int8_matmul_reference

        return Int8Linear(in_features, out_features, bias, getattr(ops, "int8_matmul", int8_matmul_reference), tp)
    if quantization in ("gptq", "awq"):  # a 4-bit checkpoint's projections (model/w4a16.py)
        from llmserve.model.w4a16 import W4A16Linear, w4a16_matmul_reference

        return W4A16Linear(in_features, out_features, bias, getattr(ops, "w4a16_matmul", w4a16_matmul_reference), tp)
    if tp is not None:
        from llmserve.model.tensor_parallel import RowParallelLinear

        return RowParallelLinear(in_features, out_features, bias, tp, linear)
    return DenseLinear(in_features, out_features, bias, linear)


def projection_paths(arch) -> tuple[str, ...]:
    """The paths, inside a decoder layer, of the linear layers `--quantization fp8` quantizes
    (the model family's declaration: model/interface.py)."""
    from llmserve.model.registry import family_of

    return tuple(spec.path for spec in family_of(arch).linears(arch) if spec.fp8)


def projection_names(arch) -> list[str]:
    """The module names `--quantization fp8` quantizes, as `named_modules` gives them."""
    from llmserve.model.registry import family_of

    specs = [s for s in family_of(arch).linears(arch) if s.fp8]
    return [f"model.layers.{i}.{s.path}" for i in range(arch.num_layers) for s in specs if s.in_layer(i)]


def projection_parts(arch) -> dict[str, list[str]]:
    """Each quantized module's name -> the checkpoint module names it loads from (a fused layer's
    parts: model.layers.0.self_attn.qkv_proj -> ...q_proj, ...k_proj, ...v_proj)."""
    from llmserve.model.registry import family_of

    specs = [s for s in family_of(arch).linears(arch) if s.fp8]
    return {f"model.layers.{i}.{s.path}": [f"model.layers.{i}.{s.parent}.{p}" for p in s.parts]
            for i in range(arch.num_layers) for s in specs if s.in_layer(i)}  # fmt: skip


def is_ignored(name: str, patterns: tuple[str, ...], whole: bool = True) -> bool:
    """An ignore list's semantics: a pattern is a module's full name, or `re:` and a regular
    expression the whole name must match (`--quantization-ignore`), or, with `whole` False, that
    matches from the name's start (`re.match`: how compressed-tensors and vLLM read a
    checkpoint's list)."""
    match = re.fullmatch if whole else re.match
    return any(name == p or (p.startswith("re:") and match(p[3:], name) is not None) for p in patterns)


def unmatched_patterns(patterns: tuple[str, ...], arch) -> list[str]:
    """The patterns that name none of the projections (a typo, or another model's layer)."""
    names = projection_names(arch)
    return [p for p in patterns if not any(is_ignored(n, (p,)) for n in names)]


def keep_unquantized(model: nn.Module, patterns: tuple[str, ...]) -> None:
    """Put a plain (bf16/fp16) linear layer in place of each FP8 (or INT8) projection `patterns` name,
    before the weights load: the checkpoint's weights then load into it as they are."""
    from llmserve.model.int8 import Int8Linear

    for name, module in list(model.named_modules()):
        if isinstance(module, (Fp8Linear, Int8Linear)) and is_ignored(name, patterns):
            parent, _, attr = name.rpartition(".")
            out_features, in_features = module.weight.shape
            plain = make_linear(in_features, out_features, module.bias is not None, None, module.matmul, module.tp)
            setattr(model.get_submodule(parent), attr, plain)


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return weight.to(torch.float32) * scale


__all__ = [
    "FP8",
    "Fp8Linear",
    "Fp8Tokens",
    "QUANTIZATION_METHODS",
    "dequantize",
    "fp8_gemm_reference",
    "fp8_gemm_scaled_mm",
    "fp8_matmul_reference",
    "fp8_matmul_scaled_mm",
    "is_fp8",
    "make_linear",
    "quantize_rows",
    "quantize_tokens",
    "quantized",
]
