"""Attention over a paged KV cache: the metadata of one flattened batch and the
PyTorch reference implementation (the CPU path, and the oracle for GPU kernels).

KV cache layout per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(keys at index 0, values at 1), in the model's dtype or in FP8 E4M3 (`--kv-cache-dtype fp8`:
keys divided by the layer's k_scale and values by its v_scale (`kv_scales`), saturating at
+-448, read back in the queries' dtype and multiplied by the scales). A token at position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size`.

Attention is causal: the query at position p sees the keys at positions <= p; with a sliding
`window` W (Hugging Face's semantics: Mistral, Gemma's local layers) only those with p - W < k <= p,
W keys including its own.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from llmserve.attention_metadata import FP8_KV, FP8_KV_MAX, AttentionMetadata, to_cache_dtype

__all__ = [
    "FP8_KV",
    "FP8_KV_MAX",
    "AttentionBackend",
    "AttentionMetadata",
    "reference_paged_attention",
    "to_cache_dtype",
    "write_kv_cache",
]


class AttentionBackend(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        out: torch.Tensor | None = None,  # [T, Hq, D] to write the result into
        kv_scales: tuple[float, float] = (1.0, 1.0),  # an FP8 cache's key and value scales
        window: int | None = None,  # sliding window: the query at p sees keys in (p - window, p]; None: all
    ) -> torch.Tensor: ...


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Scatter the new tokens' keys and values into their cache slots (slot < 0: skip); an FP8
    cache holds them divided by `kv_scales`."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    flat[0, slot_mapping] = to_cache_dtype(k, flat.dtype, kv_scales[0])
    flat[1, slot_mapping] = to_cache_dtype(v, flat.dtype, kv_scales[1])


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one sequence's first `seq_len` positions: [seq_len, Hkv, D] each."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = kv_cache[:, block_table[:num_blocks].long()]  # [2, n, bs, Hkv, D]
    kv = blocks.flatten(1, 2)[:, :seq_len]
    return kv[0], kv[1]


def reference_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    window: int | None = None,
) -> torch.Tensor:
    """Write the new K/V, then attend each sequence's new queries over its whole context.

    q: [T, Hq, D]; k, v: [T, Hkv, D]. Returns [T, Hq, D] (`out`, if given). Causal: the query
    at position p sees keys at positions <= p, and with a `window` only those > p - window. One
    SDPA call per sequence over all its keys, masked, keeps it obviously correct. An FP8 cache's
    keys and values are multiplied back by `kv_scales`.
    """
    assert window is None or window >= 1, window
    fp8 = kv_cache.dtype == FP8_KV
    write_kv_cache(k, v, kv_cache, meta.slot_mapping, kv_scales)
    if out is None:
        out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    for i, seq_len in enumerate(seq_lens):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        keys, values = gather_kv(kv_cache, meta.block_tables[i], seq_len)
        if fp8:  # an FP8 cache reads back times its scales (exact for scale 1), in q's dtype
            keys, values = keys.float() * kv_scales[0], values.float() * kv_scales[1]
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        query_len = end - start
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [Lq, S]
        if window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - window
        attn = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),  # [Hq, Lq, D]
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = attn.transpose(0, 1)
    return out
