"""EAGLE-3's draft vocabulary: the tokens its LM head can propose (`draft_vocab_size` rows), and
the maps between target and draft ids the checkpoint carries (`d2t`: draft id + d2t[draft id] =
target id; `t2d`: a mask of the target ids kept)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftVocab:
    target_ids: torch.Tensor  # [draft_vocab_size] the target ids kept, ascending (draft id = index)
    vocab_size: int  # the target's

    @property
    def size(self) -> int:
        return len(self.target_ids)

    def d2t(self) -> torch.Tensor:
        return self.target_ids - torch.arange(self.size)

    def t2d(self) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[self.target_ids] = True
        return mask

    def draft_index(self) -> torch.Tensor:
        """[vocab_size] each target id's draft id, -1 where it has none."""
        index = torch.full((self.vocab_size,), -1, dtype=torch.long)
        index[self.target_ids] = torch.arange(self.size)
        return index


def choose_draft_vocab(labels: Counter[int], context: Counter[int], vocab_size: int, size: int) -> DraftVocab:
    """The `size` tokens (at most the vocabulary) the head should be able to propose: the tokens
    the target generated, most frequent first, then the other tokens of the training text, then
    the lowest ids (a BPE vocabulary's earliest merges are its most common pieces)."""
    size = min(size, vocab_size)
    chosen: list[int] = [t for t, _ in labels.most_common() if t < vocab_size][:size]
    kept = set(chosen)
    for source in ([t for t, _ in context.most_common()], range(vocab_size)):
        for t in source:
            if len(chosen) == size:
                break
            if t not in kept and t < vocab_size:
                chosen.append(t)
                kept.add(t)
    return DraftVocab(torch.tensor(sorted(chosen), dtype=torch.long), vocab_size)
