"""Exponential noise that is a function of (seed, output position, token id): seeded
sampling in batched form.

The sampler draws a token by the exponential race (argmax of p / E, E ~ Exp(1)). A seeded
request's E comes from a counter-based hash instead of a stateful generator, so that:
- every seeded row of a batch is drawn by the same few tensor ops (no per-request kernel);
- a row's noise for a token does not depend on which other tokens are computed: the
  top-k fast path, which races only the k best candidates, picks the same token as the
  full-vocabulary race (every other token has probability 0 there);
- the tokens of a request depend on its seed alone, not on its batch or its step timing.

The hash works on 32-bit values held in int64 tensors, so no product overflows.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27: a 32-bit value times it stays below 2**59
_SALT = 0x9E3779B9


def _h32(x):
    """A 32-bit integer mix (x in [0, 2**32)): on int64 tensors, and on Python ints."""
    x = (((x >> 16) ^ x) * _MUL) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def row_key(seed: int, position: int) -> tuple[int, int]:
    """Two 32-bit keys for a row, from its seed (any int in [0, 2**64)) and the index of the
    output token being sampled (host-side: the sampler copies a batch's keys at once)."""
    key = _h32((seed & _M32) ^ _h32(((seed >> 32) & _M32) ^ _h32(position & _M32)))
    return key, _h32(key ^ _SALT)


def exponential(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise [B, K] (float32) for rows keyed by `keys` [B, 2] (int64, `row_key`) at `token_ids` ([B, K],
    or [K] shared by every row): 53 uniform bits from two hashes, then -log(u)."""
    ids = token_ids.to(torch.int64)
    if ids.dim() == 1:
        ids = ids[None, :]
    high = _h32(keys[:, :1] ^ ids)
    low = _h32(keys[:, 1:] ^ _h32(ids ^ _SALT))
    bits = (high << 21) | (low >> 11)  # 53 bits
    u = (bits.to(torch.float64) + 0.5) * (2.0**-53)  # in (0, 1): never log(0)
    return (-torch.log(u)).to(torch.float32)
