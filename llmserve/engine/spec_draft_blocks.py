"""The draft model's KV blocks: its own pool, one block table a request, and what each
request's draft cache holds (engine/spec_draft.py runs the draft over it).

The draft's cache is apart from the target's: its blocks come from a pool of its own, never
shared and never in a prefix cache, so nothing the target does to its blocks (prefix-cache hits
and evictions, preemption by recompute or swap, the host tier) can touch the draft's KV. What
a request's draft cache holds is described by tokens alone:

- `real`: positions [0, real) hold the KV of the request's own tokens (they only ever grow:
  a request's known tokens never change);
- `guesses`: the proposals the draft fed after them last step (their KV at real, real + 1, ...).

Before each proposal `sync` compares the guesses with the tokens the request has now: the
accepted ones become real and the rest are rolled back (the draft's computed length set back;
their KV is overwritten when the positions are fed again). The tokens from `real` on are then fed
(the target's token after the accepted proposals, and a proposal the draft did not feed).

The pool is a cache too: a request that stops speculating (the batch grew, it was preempted)
keeps its draft blocks until the pool runs short, when the least recently proposing requests
outside the step lose theirs (`reserve`) and later start their draft cache over.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class DraftSeq:
    """One request's draft cache."""

    block_ids: list[int] = field(default_factory=list)  # a new list when the request starts over
    real: int = 0  # positions holding the KV of the request's own tokens
    guesses: list[int] = field(default_factory=list)  # proposals fed after them (KV at real, ...)


class DraftBlocks:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))
        self.seqs: OrderedDict[str, DraftSeq] = OrderedDict()  # least recently proposing first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def sync(self, request_id: str, tokens: list[int]) -> int:
        """Roll the request's draft cache back to what it holds of `tokens` (the request's tokens
        now); returns the first position to feed. The last token is always fed: its logits give
        the first proposal."""
        seq = self.seqs.get(request_id)
        if seq is None:
            seq = self.seqs[request_id] = DraftSeq()
        self.seqs.move_to_end(request_id)
        kept = 0
        for guess in seq.guesses:
            if seq.real + kept >= len(tokens) or tokens[seq.real + kept] != guess:
                break
            kept += 1
        seq.real = min(seq.real + kept, len(tokens) - 1)
        seq.guesses = []
        return seq.real

    def reserve(self, request_id: str, num_positions: int, keep: set[str]) -> bool:
        """Blocks for the request's positions [0, num_positions): from the free blocks, then from
        the least recently proposing requests not in `keep` (their caches start over). False if
        the pool cannot hold them (the request does not speculate this step)."""
        seq = self.seqs[request_id]
        need = -(-num_positions // self.block_size) - len(seq.block_ids)
        if need <= 0:
            return True
        for victim in [rid for rid in self.seqs if rid not in keep and rid != request_id]:
            if len(self._free) >= need:
                break
            self.forget(victim)
        if len(self._free) < need:
            return False
        seq.block_ids.extend(self._free.pop() for _ in range(need))
        return True

    def fed(self, request_id: str, num_real: int, guesses: list[int]) -> None:
        """After a proposal: the request's tokens up to `num_real` and then `guesses` are in the cache."""
        seq = self.seqs[request_id]
        seq.real = num_real
        seq.guesses = list(guesses)

    def forget(self, request_id: str) -> None:
        """The request's draft blocks go back to the pool."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self._free.extend(reversed(seq.block_ids))
