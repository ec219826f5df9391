"""FP8 weights with one float32 scale per (bn, bk) block: the layout of `quant_method: fp8`
checkpoints with `weight_block_size` (DeepSeek-V3, Qwen3-*-FP8: 128 x 128), whose scales are
named `weight_scale_inv` (the factor that dequantizes: w = q * s, despite the name).

A weight `[..., N, K]` has scales `[..., ceil(N / bn), ceil(K / bk)]`, the last row and column of
blocks partial. The experts keep these scales (the fused MoE kernels apply them per K step); a
dense projection of such a checkpoint is dequantized here and quantized again per output
channel as it loads (`merge_block_scales`), which the FP8 linear layers run.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from llmserve.model.fp8 import FP8, FP8_MAX

BLOCK_SCALE_SUFFIX = ".weight_scale_inv"
_MIN_SCALE = 1e-12


def block_grid(shape: tuple[int, ...], block_shape: tuple[int, int]) -> tuple[int, int]:
    """The scale grid `(ceil(N / bn), ceil(K / bk))` of a weight whose last two dimensions are (N, K)."""
    n, k = shape[-2:]
    return -(-n // block_shape[0]), -(-k // block_shape[1])


def expand_block_scales(scale: torch.Tensor, shape: tuple[int, ...], block_shape: tuple[int, int]) -> torch.Tensor:
    """Scales `[..., Nb, Kb]` repeated to one a weight element `[..., N, K]`."""
    n, k = shape[-2:]
    scale = scale.repeat_interleave(block_shape[0], dim=-2)[..., :n, :]
    return scale.repeat_interleave(block_shape[1], dim=-1)[..., :k]


def dequantize_blocks(w: torch.Tensor, scale: torch.Tensor, block_shape: tuple[int, int]) -> torch.Tensor:
    """FP8 `w [..., N, K]` times its block scales, in float32."""
    return w.to(torch.float32) * expand_block_scales(scale.to(torch.float32), tuple(w.shape), block_shape)


def quantize_blocks(w: torch.Tensor, block_shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [..., N, K]` in FP8 E4M3 with a float32 scale per block (amax / 448): (q, scales
    `[..., Nb, Kb]`). How the tests write a block-quantized checkpoint, as published ones are."""
    w = w.to(torch.float32)
    n, k = w.shape[-2:]
    bn, bk = block_shape
    nb, kb = block_grid(tuple(w.shape), block_shape)
    padded = torch.zeros(*w.shape[:-2], nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = w
    tiles = padded.reshape(*w.shape[:-2], nb, bn, kb, bk)
    scale = (tiles.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp(min=_MIN_SCALE)  # [..., nb, kb]
    q = (w / expand_block_scales(scale, tuple(w.shape), block_shape)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.contiguous()


def merge_block_scales(
    weights: Iterable[tuple[str, torch.Tensor]], block_shape: tuple[int, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A block-scaled checkpoint's dense tensors as the model loads them (the experts', whose
    block scales the model keeps, never come here): a tensor without a block scale passes as it
    is; an FP8 weight is met with its `weight_scale_inv` (in either order) and given dequantized,
    in float32, under its name (the FP8 linear layer quantizes it per output channel). A scale of
    the wrong grid is refused, named; a weight whose scale never comes is given as it is (the
    model refuses an FP8 weight without a scale)."""
    waiting: dict[str, torch.Tensor] = {}  # module -> the FP8 weight or the scale seen first
    for name, tensor in weights:
        if name.endswith(BLOCK_SCALE_SUFFIX):
            module, is_scale = name.removesuffix(BLOCK_SCALE_SUFFIX), True
        elif name.endswith(".weight") and tensor.dtype == FP8:
            module, is_scale = name.removesuffix(".weight"), False
        else:
            yield name, tensor
            continue
        other = waiting.pop(module, None)
        if other is None:
            waiting[module] = tensor
            continue
        weight, scale = (other, tensor) if is_scale else (tensor, other)
        check_block_scale(module + BLOCK_SCALE_SUFFIX, scale, tuple(weight.shape), block_shape)
        yield module + ".weight", dequantize_blocks(weight, scale, block_shape)
    for module, tensor in waiting.items():
        if tensor.dtype != FP8:
            raise ValueError(f"checkpoint tensor {module + BLOCK_SCALE_SUFFIX!r}: a block scale without its FP8 weight")
        yield module + ".weight", tensor


def check_block_scale(
    name: str, scale: torch.Tensor, weight_shape: tuple[int, ...], block_shape: tuple[int, int]
) -> None:
    """A block scale's shape must be its weight's grid (`block_grid`); else refused, named."""
    want = block_grid(weight_shape, block_shape)
    if tuple(scale.shape) != want:
        raise ValueError(f"checkpoint tensor {name!r}: shape {tuple(scale.shape)}, but a weight of {tuple(weight_shape[-2:])} "
                         f"in blocks of {tuple(block_shape)} takes {want} scales")  # fmt: skip
