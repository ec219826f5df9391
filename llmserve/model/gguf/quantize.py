"""Float weights into GGUF block formats (NumPy), for writing test checkpoints.

Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 use the `gguf` package's quantizers (llama.cpp's own rounding). The
K-quants, which that package cannot write, are quantized here by a plain min/max rule:
valid blocks that decode to values near the input, not llama.cpp's error-minimizing
search. Models served from such files are tests, not products.
"""

from __future__ import annotations

import numpy as np

from llmserve.model.gguf.dequant import BLOCKS, QK_K


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _bytes(*columns: np.ndarray) -> np.ndarray:
    """Per-block fields, each [n, ...] of any dtype, laid side by side as [n, bytes]."""
    n = columns[0].shape[0]
    return np.concatenate([np.ascontiguousarray(c).reshape(n, -1).view(np.uint8) for c in columns], axis=1)


def _pack_nibble_runs(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] four-bit values -> [n, 128] bytes: sub-blocks 2i and 2i+1 share run i
    (low and high nibbles)."""
    q = q.astype(np.uint8).reshape(q.shape[0], 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(q.shape[0], 128)


def _k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per super-block -> 12 bytes (the inverse of dequant._k_scales)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    lo = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mid = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([lo, mid, hi], axis=1)


def _asymmetric(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Super-blocks [n, 8, 32] as d*sc*q - dmin*m with six-bit sc, m and q in [0, levels]."""
    lo = np.minimum(x.min(axis=-1), 0.0)
    hi = np.maximum(x.max(axis=-1), 0.0)
    scale, shift = (hi - lo) / levels, -lo
    d = _f16(scale.max(axis=-1) / 63.0)
    dmin = _f16(shift.max(axis=-1) / 63.0)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63)
    mn = np.clip(np.rint(np.divide(shift, dminf, out=np.zeros_like(shift), where=dminf > 0)), 0, 63)
    step, offset = (df * sc)[..., None], (dminf * mn)[..., None]
    q = np.divide(x + offset, step, out=np.zeros_like(x), where=step > 0)
    return d, dmin, sc, mn, np.clip(np.rint(q), 0, levels).astype(np.uint8)


def _q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _asymmetric(x.reshape(-1, 8, 32), 15)
    return _bytes(d, dmin, _k_scale_bytes(sc, mn), _pack_nibble_runs(q))


def _q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _asymmetric(x.reshape(-1, 8, 32), 31)
    high = ((q >> 4) & 1).astype(np.uint8)  # [n, 8, 32]: bit j of byte l is value l of sub-block j
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    return _bytes(d, dmin, _k_scale_bytes(sc, mn), qh, _pack_nibble_runs(q & 0x0F))


def _q6_k(x: np.ndarray) -> np.ndarray:
    x = x.reshape(-1, 16, 16)  # 16 groups of 16 values, a signed eight-bit scale each
    scale = np.abs(x).max(axis=-1) / 31.0
    d = _f16(scale.max(axis=-1) / 127.0)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), -128, 127)
    step = (df * sc)[..., None]
    q = np.clip(np.rint(np.divide(x, step, out=np.zeros_like(x), where=step > 0)), -32, 31)
    u = (q + 32).astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128 values
    n = u.shape[0]
    ql = np.zeros((n, 2, 64), dtype=np.uint8)
    qh = np.zeros((n, 2, 32), dtype=np.uint8)
    for r in range(128):  # value r of a half: a nibble of byte r % 64, two bits of byte r % 32
        ql[:, :, r % 64] |= (u[:, :, r] & 0x0F) << (4 * (r // 64))
        qh[:, :, r % 32] |= (u[:, :, r] >> 4) << (2 * (r // 32))
    return _bytes(ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8), d)


_OWN = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def quantize(weight: np.ndarray, type_name: str) -> np.ndarray:
    """A float tensor (rows along the last dimension) as the bytes of `type_name`, shaped
    [rows..., bytes per row] as the `gguf` writer expects raw data."""
    import gguf

    per_block, _ = BLOCKS[type_name]
    if weight.shape[-1] % per_block:
        raise ValueError(f"{type_name} packs rows in blocks of {per_block} values; a row here has {weight.shape[-1]}")
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if type_name == "F32":
        return weight
    if type_name in _OWN:
        rows = weight.reshape(-1, weight.shape[-1])
        packed = _OWN[type_name](rows.reshape(-1, QK_K))
        return packed.reshape(*weight.shape[:-1], -1)
    return gguf.quants.quantize(weight, gguf.GGMLQuantizationType[type_name])
