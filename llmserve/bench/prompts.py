"""Random token-id prompts: the synthetic workload every `llmserve bench` command uses.

Random ids (not text) give exact prompt lengths, and a fresh seed per run keeps prefix
caching from reusing anything between runs. No torch here: `bench serve` is a client.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# ids below this are often special tokens (pad, bos, eos, ...) in common vocabularies
FIRST_ID = 10


@dataclass(frozen=True, slots=True)
class SyntheticRequest:
    prompt_token_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def draw_len(rng: random.Random, length: int, ratio: float) -> int:
    """A length uniform in [length * (1 - ratio), length * (1 + ratio)], at least 1."""
    lo, hi = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return rng.randint(lo, hi)


def random_requests(
    num: int, input_len: int, output_len: int, vocab_size: int, seed: int | None, range_ratio: float = 0.0
) -> list[SyntheticRequest]:
    """`num` requests of random prompt ids in [FIRST_ID, vocab_size); seed None: a fresh one."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if vocab_size <= FIRST_ID:
        raise ValueError(f"vocab_size must be > {FIRST_ID}, got {vocab_size}")
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        ids = [rng.randrange(FIRST_ID, vocab_size) for _ in range(draw_len(rng, input_len, range_ratio))]
        out.append(SyntheticRequest(ids, draw_len(rng, output_len, range_ratio)))
    return out
