"""What `llmserve train-eagle` reports of a head: step 0's top-1 accuracy and the acceptance
length greedy speculative decoding would see, walked through each sequence."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BatchStats:
    """One batch's counts."""

    loss: float
    correct: int  # step 0's right proposals
    positions: int
    walked: int  # tokens the walk's verifications made
    verifications: int


@dataclass
class EpochStats:
    """One pass over some sequences: the mean loss; step 0's top-1 accuracy (a generated position
    whose next token the head's first proposal gets right; a token outside the draft vocabulary
    is a miss); and the acceptance length greedy decoding with K = `ttt_steps` proposals would
    see, walked through each sequence (tokens a verification makes: 1 + the leading correct
    proposals; exact teacher-forced, since a correct chain feeds the true tokens)."""

    loss: float = 0.0
    top1: float = 0.0
    acceptance_length: float = 0.0
    positions: int = 0  # generated positions (step 0's labels)
    verifications: int = 0  # steps of the walk

    def add(self, batch: BatchStats) -> None:
        n = self.positions + batch.positions
        if n:
            self.loss = (self.loss * self.positions + batch.loss * batch.positions) / n
            self.top1 = (self.top1 * self.positions + batch.correct) / n
        v = self.verifications + batch.verifications
        if v:
            self.acceptance_length = (self.acceptance_length * self.verifications + batch.walked) / v
        self.positions, self.verifications = n, v

    def as_dict(self) -> dict:
        return {"loss": self.loss, "top1": self.top1, "acceptance_length": self.acceptance_length,
                "positions": self.positions}  # fmt: skip


def walk(lead: list[list[int]], prompt_lens: list[int], lengths: list[int]) -> tuple[int, int]:
    """Greedy speculative decoding through each sequence: (tokens made, verifications). The
    first proposal comes from pair prompt_len - 1 (the target sampled the first token itself);
    a verification at pair t makes 1 + lead[t] tokens, so the next starts at pair t + 1 + lead[t]."""
    tokens = steps = 0
    for row, start, n in zip(lead, prompt_lens, lengths):
        t = start - 1
        while t + 2 < n:  # (pair t proposes token t + 2)
            made = min(1 + row[t], n - t - 2)
            tokens, steps, t = tokens + made, steps + 1, t + made
    return tokens, steps
