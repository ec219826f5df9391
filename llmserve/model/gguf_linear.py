"""GGUF linear layers kept quantized: a projection holds its GGUF blocks on the device, and the
product dequantizes them inside the GEMM (llmserve/kernels/gguf_linear.py) instead of the loader
dequantizing the whole model to 16 bits (a 7B Q4_K_M file: 4.4 GB of blocks, 15 GB in bf16).

A GGUF tensor is rows of blocks, each block an array of structs (ggml-common.h): Q8_0 is an fp16
scale and 32 int8 values; Q5_0 an fp16 scale, 32 fifth bits and 32 nibbles, w = d * (q - 16)
(what Q4_K_M files hold where a row is not whole super-blocks: Gemma 3 270M's q/k/v/gate/up);
Q4_K/Q5_K a 256-value super-block with fp16 d and dmin, eight 6-bit
scales and mins packed in 12 bytes, and 4-bit values (plus a fifth bit for Q5_K), w = d * sc * q -
dmin * m; Q6_K 256 values in 6 bits with sixteen int8 scales and an fp16 d, w = d * sc * (q - 32).
At load each block's fields are split into arrays of their own, output rows first
(`BlockFormat.fields`): `qs` [N, K / 256 * 128] bytes, `d` fp16 [N, K / 256], ... A kernel then
reads aligned, typed fields, and joining them back gives the file's bytes (`blocks_of`), so the
reference is the loader's own dequantizer (model/gguf/dequant.py) on exactly those bytes.

None of these maps exactly onto the W4A16 layout (w = (q - z) * s with an integer zero point
z): Q4_K's offset dmin * m is a float of its own per 32 values, Q6_K has 6 bits and sixteen
scales, Q8_0 a scale per 32 values (the INT8 layer's is per row), Q5_0 five bits. Each has its own
kernel.

A layer is a stack of pieces along its outputs, each one part's rows (q, k, v of a fused
q/k/v; adjacent parts of one format join): `GGUFBlocks` for a kept format, `DenseRows` (the
model's dtype) for a part whose format is not kept (Q4_0, Q4_1, Q5_1, F16, ...), so a Q4_K_M file's q/k in
Q4_K and v in Q6_K each keep their own format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model.gguf.dequant import BLOCKS, dequantize


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a block: `size` bytes at `offset`, read as `dtype`."""

    name: str
    offset: int
    size: int
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class BlockFormat:
    name: str  # the GGUF type name
    fields: tuple[Field, ...]  # in block order, covering every byte

    @property
    def block(self) -> int:
        """Weights a block holds."""
        return BLOCKS[self.name][0]

    @property
    def nbytes(self) -> int:
        return BLOCKS[self.name][1]


_U8, _I8, _F16 = torch.uint8, torch.int8, torch.float16
# fmt: off
KEPT_FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("Q8_0", (Field("d", 0, 2, _F16), Field("qs", 2, 32, _I8))),
    BlockFormat("Q5_0", (Field("d", 0, 2, _F16), Field("qh", 2, 4, _U8), Field("qs", 6, 16, _U8))),
    BlockFormat("Q4_K", (Field("d", 0, 2, _F16), Field("dmin", 2, 2, _F16), Field("scales", 4, 12, _U8),
                         Field("qs", 16, 128, _U8))),
    BlockFormat("Q5_K", (Field("d", 0, 2, _F16), Field("dmin", 2, 2, _F16), Field("scales", 4, 12, _U8),
                         Field("qh", 16, 32, _U8), Field("qs", 48, 128, _U8))),
    BlockFormat("Q6_K", (Field("ql", 0, 128, _U8), Field("qh", 128, 64, _U8), Field("scales", 192, 16, _I8),
                         Field("d", 208, 2, _F16))),
)}
# fmt: on


def split_blocks(raw: torch.Tensor, fmt: BlockFormat, rows: int) -> dict[str, torch.Tensor]:
    """A tensor's bytes (whole rows of blocks) -> each field [rows, blocks * size / itemsize]."""
    blocks = raw.reshape(rows, -1, fmt.nbytes)
    return {f.name: blocks[:, :, f.offset : f.offset + f.size].contiguous().view(f.dtype).reshape(rows, -1)
            for f in fmt.fields}  # fmt: skip


def join_blocks(fields: dict[str, torch.Tensor], fmt: BlockFormat) -> torch.Tensor:
    """`split_blocks`'s inverse: uint8 [rows, blocks * nbytes], the file's bytes."""
    rows = next(iter(fields.values())).shape[0]
    parts = [fields[f.name].contiguous().view(torch.uint8).reshape(rows, -1, f.size) for f in fmt.fields]
    return torch.cat(parts, dim=-1).reshape(rows, -1)


class GGUFBlocks(nn.Module):
    """`rows` output rows of `in_features` inputs in a kept GGUF format, its fields as parameters."""

    def __init__(self, type_name: str, rows: int, in_features: int) -> None:
        super().__init__()
        fmt = KEPT_FORMATS[type_name]
        if in_features % fmt.block:
            raise ValueError(f"{type_name} rows are blocks of {fmt.block}; {in_features} inputs are not whole blocks")
        self.type_name, self.rows, self.in_features = type_name, rows, in_features
        blocks = in_features // fmt.block
        for f in fmt.fields:
            shape = (rows, blocks * f.size // f.dtype.itemsize)
            self.register_parameter(f.name, nn.Parameter(torch.empty(shape, dtype=f.dtype), requires_grad=False))

    @property
    def format(self) -> BlockFormat:
        return KEPT_FORMATS[self.type_name]

    def fields(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in self.format.fields}

    def load_raw(self, raw: torch.Tensor) -> None:
        """Fill from the file's bytes of these rows."""
        with torch.no_grad():
            for name, value in split_blocks(raw, self.format, self.rows).items():
                getattr(self, name).copy_(value)

    def raw(self) -> torch.Tensor:
        return join_blocks(self.fields(), self.format)

    def dequantized(self) -> torch.Tensor:
        """float32 [rows, in_features]: the loader's dequantizer on the file's bytes."""
        return dequantize(self.raw(), self.type_name, (self.rows, self.in_features))


class DenseRows(nn.Module):
    """Rows of a part whose format is not kept: dequantized at load, in the model's dtype."""

    type_name = "dense"

    def __init__(self, rows: int, in_features: int) -> None:
        super().__init__()
        self.rows, self.in_features = rows, in_features
        self.weight = nn.Parameter(torch.empty(rows, in_features), requires_grad=False)

    def dequantized(self) -> torch.Tensor:
        return self.weight


Piece = GGUFBlocks | DenseRows


def gguf_matmul_reference(x: torch.Tensor, pieces: list[Piece], bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ the pieces' weights stacked and dequantized (float32, rounded to x's dtype)^T (+ bias),
    as the dequantize-at-load path computes it (`F.linear` on the whole weight)."""
    w = torch.cat([p.dequantized().to(x.dtype) for p in pieces])
    return F.linear(x, w, bias)


class GGUFLinear(nn.Module):
    """A projection as GGUF blocks: `pieces` stacked along the outputs (`piece_specs`: (type name,
    rows) each, a type name not in KEPT_FORMATS giving dense rows). One rank's: column-parallel or
    plain (`tp` None: its rows of every part), or row-parallel (`tp` given: its whole blocks of
    the inputs, the outputs summed over the ranks, the bias added once after)."""

    def __init__(self, in_features: int, piece_specs: list[tuple[str, int]], bias: bool,
                 matmul=gguf_matmul_reference, tp=None) -> None:  # fmt: skip
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(rows for _, rows in piece_specs)
        self.matmul = matmul
        self.tp = tp
        self.pieces = nn.ModuleList(GGUFBlocks(t, rows, in_features) if t in KEPT_FORMATS else DenseRows(rows, in_features)
                                    for t, rows in piece_specs)  # fmt: skip
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None

    def dequantized(self) -> torch.Tensor:
        return torch.cat([p.dequantized().float() for p in self.pieces])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.tp is not None and self.tp.world_size > 1:
            y = self.tp.all_reduce(self.matmul(x, list(self.pieces)))
            y = y if self.bias is None else y + self.bias
        else:
            y = self.matmul(x, list(self.pieces), self.bias)
        return y.reshape(*shape[:-1], y.shape[-1])


def layer_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's parameters: `kept` (GGUF blocks), `total`."""
    kept = sum(
        p.numel() * p.element_size() for m in model.modules() if isinstance(m, GGUFBlocks) for p in m.parameters()
    )
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"kept": kept, "total": total}


__all__ = ["KEPT_FORMATS", "BlockFormat", "DenseRows", "Field", "GGUFBlocks", "GGUFLinear", "Piece",
           "gguf_matmul_reference", "join_blocks", "layer_bytes", "split_blocks"]  # fmt: skip
