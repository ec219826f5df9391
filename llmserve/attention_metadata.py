"""What the attention of one flattened batch needs to know, as plain tensors and numbers, and
how the KV cache stores values. A leaf module: the model's reference attention, the Triton
kernels and the engine all read it, and it imports none of them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Describes one flattened batch of B sequences and T new tokens."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V is written to
    query_start_loc: torch.Tensor  # [B + 1] int32: offsets of each sequence's new tokens
    seq_lens: torch.Tensor  # [B] int32: context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # how many sequences at the front have exactly one new token (decodes); 0: not counted
    num_decode_seqs: int = 0
    # (sequence, its first row in the batch, its tokens) of each sequence of several new tokens
    # and no cached prefix (a whole prompt, or its first chunk), in batch order; known on the
    # host, so long ones can go to torch's SDPA over their own q/k/v. Empty: not listed
    fresh_seqs: tuple[tuple[int, int, int], ...] = ()
    # (sequence, its first row, its new tokens, its cached tokens) of each sequence of several new
    # tokens after a cached prefix (a prompt's later chunk) no longer in all than the input
    # builder's `chunk_total_limit`, in batch order: a long one can go to SDPA over its whole
    # sequence, gathered from the cache. Empty: not listed
    chunk_seqs: tuple[tuple[int, int, int, int], ...] = ()
    # with several KV groups (engine/kv_layout.py): the metadata of groups 1, 2, ..., each with its
    # own slot mapping and block tables (this one is group 0's); a layer attends with its group's
    groups: tuple[AttentionMetadata, ...] = ()


@dataclass(slots=True)
class SampledRows:
    """The rows of a batch that sample (each its sequence's last new token), for a last layer run
    on them alone. Every layer writes the keys and values of all rows, but only these rows'
    hidden states reach the LM head, so the last layer's attention, output projection and MLP
    need no other row (a 7,680-token prompt: 1 of 7,680 rows)."""

    rows: torch.Tensor  # [k] int64: their rows in the batch, in order
    # the attention of k one-token queries over the cache, one a sampling sequence; its
    # slot_mapping is the whole batch's (every row's keys and values are written)
    meta: AttentionMetadata


FP8_KV = torch.float8_e4m3fn
FP8_KV_MAX = 448.0


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Values as the cache stores them: an FP8 cache holds x / scale (the layer's key or value
    scale), saturated at +-448; any other cache holds x (its scale is 1)."""
    if dtype == FP8_KV:
        return (x.float() * (1.0 / scale)).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(dtype)
    return x.to(dtype)
