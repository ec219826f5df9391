"""A target's embedding and LM head as whole tables on one rank, for a proposer that runs there
alone (an EAGLE head under tensor parallelism: engine/spec_eagle.py).

Under tensor parallelism each rank holds its rows of the vocabulary (model/tensor_parallel.py),
and a lookup or the logits need every rank (an all-reduce, an all-gather). The head proposes on
rank 0 only, between the target's steps, so it reads these tables instead: gathered once at start
through the model's own paths (`token_embeddings` over every id, `compute_logits` over the
identity), which every rank runs together, whatever the table's storage (an INT8 embedding comes
out dequantized). With one rank the proposer reads the model itself (`ModelRunner.proposer_vocab`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve.model.interface import CausalLM

GATHER_IDS = 8192  # ids looked up a collective (8192 x hidden values), bounding the transient memory
GATHER_ROWS = 512  # identity rows a collective: their logits are 512 x V values (with their gathered parts)


class WholeVocab:
    """`token_embeddings` and `compute_logits` over whole tables (what the EAGLE head calls on its target)."""

    def __init__(self, embedding: torch.Tensor, lm_head: torch.Tensor | None) -> None:
        self.embedding = embedding  # [V, hidden]
        self.lm_head = lm_head  # [V, hidden]; None: not gathered (an EAGLE-3 head has its own)

    @classmethod
    def gather(cls, target: CausalLM, with_logits: bool, device: torch.device) -> WholeVocab:
        """Every rank of `target`'s tensor-parallel group calls this at once (the collectives inside)."""
        embedding = gather_embedding(target, device)
        return cls(embedding, gather_logits_weight(target, embedding.dtype, device) if with_logits else None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.embedding, self.lm_head) if t is not None)

    def token_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embedding)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            raise RuntimeError("the LM head was not gathered")
        return F.linear(hidden, self.lm_head)


@torch.inference_mode()
def gather_embedding(target: CausalLM, device: torch.device) -> torch.Tensor:
    """The whole embedding [V, hidden] in the dtype its rows come out in: the lookup of every id
    (every rank of the group at once; under pipeline parallelism the first stage's)."""
    vocab = target.arch.vocab_size
    ids = torch.arange(vocab, device=device)
    return torch.cat([target.token_embeddings(ids[i : i + GATHER_IDS]) for i in range(0, vocab, GATHER_IDS)])


@torch.inference_mode()
def gather_logits_weight(target: CausalLM, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The whole LM head [V, hidden]: the logits of the identity, whose row i holds W[:, i] (every
    rank of the group at once; under pipeline parallelism the last stage's). `dtype`: the hidden states'."""
    hidden = target.arch.hidden_size
    eye = torch.eye(hidden, dtype=dtype, device=device)
    head = torch.cat([target.compute_logits(eye[i : i + GATHER_ROWS]) for i in range(0, hidden, GATHER_ROWS)])
    return head.t().contiguous()
