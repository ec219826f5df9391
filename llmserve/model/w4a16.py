"""W4A16 linear layers: 4-bit weights in groups along the input (GPTQ and AWQ checkpoints), 16-bit
activations; the weights are dequantized inside the GEMM.

One layout for both formats (model/w4a16_checkpoint.py repacks each at load), output rows first
so that a fused projection's parts and a column-parallel rank's share are row ranges:
- `qweight` int32 [N, K / 8]: eight 4-bit values q[n, k] along the input, q of input k = 8 j + i
  in bits 4 i .. 4 i + 3 of word j (GPTQ's own packing, transposed);
- `scales` [N, G] (float16 or bfloat16, the checkpoint's) and `zeros` uint8 [N, G]: group g's
  scale and zero point of output row n;
- `g_idx` int32 [K]: the group of each input. Plain checkpoints have k // group_size; GPTQ's
  act-order ("desc_act") quantized the inputs in another order, so their groups are scattered:
  keeping the map (instead of permuting the inputs) serves both, and a row-parallel rank's slice
  of the inputs keeps every group's scales.
w[n, k] = (q[n, k] - zeros[n, g_idx[k]]) * scales[n, g_idx[k]].

Two implementations of the product:
- `w4a16_matmul_reference`: dequantize the whole weight (float32), round it to x's dtype and
  multiply (the definition);
- `llmserve/kernels/w4a16_linear.py`: a Triton GEMM that reads the 4-bit words and dequantizes
  in registers (decode: a quarter of bf16's weight bytes), and for many tokens the reference's
  dequantize then one 16-bit GEMM (cuBLAS's tensor cores).
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.model.tensor_parallel import TPGroup

BITS = 4
PACK = 32 // BITS  # values in one int32 word


def _shifts(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Nibble i at bits 4 i; made on `device` (a host tensor copied in would break a CUDA graph's capture)."""
    return torch.arange(0, 32, BITS, dtype=dtype, device=device)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] -> uint8 [R, C]: value c of row r from word c // 8, nibble c % 8."""
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> _shifts(torch.int32, packed.device)) & 0xF
    return nibbles.reshape(packed.shape[0], -1).to(torch.uint8)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [R, C] (C a multiple of 8) -> int32 [R, C / 8], `unpack_rows`'s inverse."""
    r, c = q.shape
    if c % PACK:
        raise ValueError(f"{c} values a row: 4-bit packing needs a multiple of {PACK}")
    words = q.to(torch.int64).reshape(r, c // PACK, PACK) << _shifts(torch.int64, q.device)
    packed = words.sum(-1)  # disjoint bits: the sum is the bitwise or
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def dequantize_w4a16(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     g_idx: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The layout's weight [N, K] in float32."""
    q = unpack_rows(qweight).to(torch.float32)
    g = g_idx.long()
    return (q - zeros.to(torch.float32)[:, g]) * scales.to(torch.float32)[:, g]


def w4a16_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                           g_idx: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """x [T, K] @ the dequantized weight^T, the weight rounded to x's dtype first; in x's dtype."""
    return x @ dequantize_w4a16(qweight, scales, zeros, g_idx).to(x.dtype).t()


class W4A16Linear(nn.Module):
    """A linear layer with 4-bit grouped weights in the layout above: column-parallel or plain
    (`tp` None), or row-parallel (`tp` given: the input is this rank's slice, the outputs are
    summed over ranks). `scales` and `zeros` get their group count when the checkpoint loads
    (`set_groups`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, matmul=w4a16_matmul_reference,
                 tp: TPGroup | None = None) -> None:  # fmt: skip
        super().__init__()
        if in_features % PACK:
            raise ValueError(f"a 4-bit layer's input width must be a multiple of {PACK}; got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.matmul = matmul
        self.tp = tp
        self.qweight = nn.Parameter(
            torch.empty(out_features, in_features // PACK, dtype=torch.int32), requires_grad=False
        )
        self.g_idx = nn.Parameter(torch.empty(in_features, dtype=torch.int32), requires_grad=False)
        self.scales = nn.Parameter(torch.empty(out_features, 0, dtype=torch.float16), requires_grad=False)
        self.zeros = nn.Parameter(torch.empty(out_features, 0, dtype=torch.uint8), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def set_groups(self, groups: int, dtype: torch.dtype) -> None:
        """Allocate `scales` ([N, groups], `dtype`) and `zeros` on the weights' device."""
        if self.scales.shape[1] == groups and self.scales.dtype == dtype:
            return
        device = self.qweight.device
        self.scales = nn.Parameter(
            torch.empty(self.out_features, groups, dtype=dtype, device=device), requires_grad=False
        )
        self.zeros = nn.Parameter(torch.empty(self.out_features, groups, dtype=torch.uint8, device=device),
                                  requires_grad=False)  # fmt: skip

    def dequantized(self) -> torch.Tensor:
        return dequantize_w4a16(self.qweight, self.scales, self.zeros, self.g_idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.matmul(x.reshape(-1, shape[-1]), self.qweight, self.scales, self.zeros, self.g_idx)
        y = y.reshape(*shape[:-1], y.shape[-1])
        if self.tp is not None and self.tp.world_size > 1:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


__all__ = ["W4A16Linear", "dequantize_w4a16", "pack_rows", "unpack_rows", "w4a16_matmul_reference"]
