"""GGUF tensor types to floating point, in PyTorch (vectorized over blocks, on any device: the
kept-quantized layers' reference and prefill path dequantize on the GPU, model/gguf_linear.py).

Each quantized type stores a tensor row by row in fixed-size blocks of bytes (ggml's
layouts: ggml-common.h). A function here takes a row-major uint8 tensor holding whole
blocks and returns float32 values in the same order. The reference these are tested
against is the `gguf` package's NumPy code (tests/test_gguf.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

QK_K = 256  # elements in a K-quant super-block

# type name -> (elements per block, bytes per block)
BLOCKS = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210),
}  # fmt: skip
SUPPORTED_TYPES = tuple(BLOCKS)


def _f16(column: torch.Tensor) -> torch.Tensor:
    """[n, 2] bytes -> [n, 1] float32 (little-endian float16)."""
    return column.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 2, k]: the low nibbles, then the high ones."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:]).reshape(-1, 32).float()  # elements 0-15 in the low nibbles, 16-31 in the high
    return _f16(b[:, :2]) * (q - 8.0)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 4:]).reshape(-1, 32).float()
    return _f16(b[:, :2]) * q + _f16(b[:, 2:4])


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1: [n, 4] bytes -> [n, 32]: bit j of the little-endian 32-bit word is the
    fifth bit of value j."""
    bits = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh.unsqueeze(-1) >> bits) & 1).reshape(-1, 32)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:]).reshape(-1, 32) | (_fifth_bits(b[:, 2:6]) << 4)
    return _f16(b[:, :2]) * (q.float() - 16.0)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:]).reshape(-1, 32) | (_fifth_bits(b[:, 4:8]) << 4)
    return _f16(b[:, :2]) * q.float() + _f16(b[:, 2:4])


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins per super-block.

    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; bytes 8-11 hold the low
    4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble), whose top 2 bits are the
    top 2 bits of bytes 0-3 and 4-7."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc.float(), mn.float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    scale = (_f16(b[:, 0:2]) * sc).unsqueeze(-1)  # [n, 8, 1]
    shift = (_f16(b[:, 2:4]) * mn).unsqueeze(-1)
    # 4 runs of 32 bytes; each run's low nibbles are one 32-value sub-block, its high nibbles the next
    q = _nibbles(b[:, 16:].reshape(n, 4, 32).reshape(n * 4, 32)).reshape(n, 8, 32).float()
    return (scale * q - shift).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    scale = (_f16(b[:, 0:2]) * sc).unsqueeze(-1)
    shift = (_f16(b[:, 2:4]) * mn).unsqueeze(-1)
    low = _nibbles(b[:, 48:].reshape(n * 4, 32)).reshape(n, 8, 32)
    bits = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
    high = (b[:, 16:48].unsqueeze(1) >> bits) & 1  # bit j of byte l: the fifth bit of value l of sub-block j
    return (scale * (low | (high << 4)).float() - shift).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()  # one per 16 values
    d = _f16(b[:, 208:210])
    low = _nibbles(ql.reshape(n * 2, 64)).reshape(n, 8, 32)  # two halves of 128 values
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)  # (no host copy: graph-safe)
    high = ((qh.reshape(n, 2, 1, 32) >> shifts) & 0x03).reshape(n, 8, 32)
    q = (low | (high << 4)).to(torch.int16) - 32
    return ((d * scales).unsqueeze(-1) * q.reshape(n, 16, 16).float()).reshape(n, QK_K)


_BLOCK_DEQUANT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}  # fmt: skip


def dequantize(raw: torch.Tensor | np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 tensor of `shape` (row-major, the last dimension a row) stored as `raw`
    bytes of GGUF type `type_name`."""
    if type_name not in BLOCKS:
        raise ValueError(f"GGUF tensor type {type_name} is not supported (supported: {', '.join(SUPPORTED_TYPES)})")
    if isinstance(raw, np.ndarray):
        raw = torch.from_numpy(
            np.array(raw, copy=True).view(np.uint8).reshape(-1)
        )  # a copy: the file's map is read-only
    raw = raw.reshape(-1)
    numel = int(np.prod(shape)) if shape else 1
    per_block, block_bytes = BLOCKS[type_name]
    if numel % per_block or raw.numel() != numel // per_block * block_bytes:
        raise ValueError(f"a {type_name} tensor of shape {tuple(shape)} needs {numel // per_block * block_bytes} "
                         f"bytes in whole blocks of {per_block}; it has {raw.numel()}")  # fmt: skip
    if type_name == "F32":
        return raw.view(torch.float32).reshape(shape).clone()
    if type_name in ("F16", "BF16"):
        return raw.view(torch.float16 if type_name == "F16" else torch.bfloat16).float().reshape(shape)
    blocks = raw.reshape(-1, block_bytes)
    return _BLOCK_DEQUANT[type_name](blocks).reshape(shape)
