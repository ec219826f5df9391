"""Speculative decoding, the core's side: which requests speculate, their proposals, the counts.

A decoding request that speculates gets K proposed tokens (engine/spec_ngram.py) appended to its
step's input: the step computes its last token and the K proposals, and the logits of all K + 1
positions come back. Verification (the runner's, `verify_greedy`) keeps the proposals up to the
first that the target model's greedy choice disagrees with, plus the target's own token there
(or a bonus token after all K): 1 to K + 1 tokens a step, each exactly the token greedy decoding
without speculation would have made. The KV of the rejected positions stays in the cache but
past the request's computed count, so the next steps overwrite it; only blocks of accepted
tokens reach the prefix cache.

A sampled request's proposals go through rejection sampling (`rejection_sample`), which keeps
the target's distribution p exactly, whatever distribution q the proposals were drawn from:
proposal i is accepted with probability min(1, p/q) of it; at the first rejection the token is
drawn from max(0, p - q), renormalised; after K accepted, a bonus token from the last position's
p. The n-gram proposer's q is all on its proposal (accepted with p of it; the residual is p without
it); a draft model's q is its own filtered distribution (engine/spec_draft.py). A seeded request
draws its noise from (seed, output position), as the sampler does, so it reproduces.

Proposers: `NgramProposer` (engine/spec_ngram.py) and the draft model's `DraftProposer`
(engine/spec_draft.py), behind one small interface (`Proposer`).

Who speculates: requests without penalties, logit bias, a grammar, or an unmet min_tokens (the sampler would change the target's distribution), while at most
`disable_by_batch_size` sequences decode (a larger batch is compute-bound: verifying K more
tokens each would cost it throughput). The others decode one token a step beside them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from llmserve.config import SpeculativeConfig
from llmserve.engine.argmax import row_argmax
from llmserve.engine.request import Request
from llmserve.engine.spec_ngram import TokenArrays, propose


def speculates(req: Request) -> bool:
    """Is `req`'s next token drawn from its logits by temperature, top-k, top-p and min-p alone
    (or their argmax), with nothing else to apply?"""
    p = req.sampling_params
    return (
        not p.presence_penalty
        and not p.frequency_penalty
        and p.repetition_penalty == 1.0
        and not p.logit_bias
        and req.matcher is None
        and p.structured_outputs is None
        and req.num_output_tokens >= p.min_tokens
    )


def verify_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens a step keeps: the drafts the target's greedy tokens (one per position, K + 1)
    confirm, then the target's token after them."""
    kept = 0
    while kept < len(drafts) and targets[kept] == drafts[kept]:
        kept += 1
    return drafts[:kept] + [targets[kept]]


def rejection_sample(filtered: torch.Tensor, drafts: torch.Tensor, uniform: torch.Tensor, noise: torch.Tensor,
                     draft_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """A sampled request's verification on the device: `filtered` [K + 1, V] its target logits after
    temperature and top-k/top-p/min-p (-inf outside), `drafts` [K], `uniform` [K] in (0, 1),
    `noise` [K + 1, V] Exp(1), and `draft_probs` [K, V] the distributions q the proposals were drawn
    from (None: each all on its proposal, as n-gram's). Returns (accepted [K] bools, the token drawn
    at each of the first K positions from max(0, p - q) [K], the bonus token [1]); `kept_tokens` reads them."""
    k = drafts.shape[0]
    probs = torch.softmax(filtered.float(), dim=-1)
    p_draft = probs[:k].gather(1, drafts[:, None])[:, 0]
    if draft_probs is None:
        accepted = uniform < p_draft
        residual = probs[:k].scatter(1, drafts[:, None], 0.0)  # max(0, p - q) with q all on the proposal
    else:
        q = draft_probs.float()
        accepted = uniform * q.gather(1, drafts[:, None])[:, 0] < p_draft  # u < min(1, p / q)
        residual = (probs[:k] - q).clamp_min(0.0)
    replacements = row_argmax(residual.log() - noise[:k].log())  # the exponential race over what is left
    bonus = row_argmax(probs[k:].log() - noise[k:].log())
    return accepted, replacements, bonus


def kept_tokens(drafts: list[int], accepted: list[bool], replacements: list[int], bonus: int) -> list[int]:
    """The proposals up to the first rejected one, then the token drawn in its place (or the bonus)."""
    kept = 0
    while kept < len(drafts) and accepted[kept]:
        kept += 1
    return drafts[:kept] + [replacements[kept] if kept < len(drafts) else bonus]


@dataclass
class SpecCounts:
    """vLLM's speculative-decoding counters."""

    num_drafts: int = 0  # verification rows (steps of a speculating request)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # position i: drafts accepted there


ACCEPTANCE_DECAY = 0.5  # weight of a request's earlier steps in its running acceptance


class Proposer(Protocol):
    """Where proposals come from."""

    def propose(self, requests: list[Request], ks: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Up to `ks[i]` tokens after `requests[i]`'s last (may be fewer, or none), and the
        distributions [k, V] they were drawn from (None: each all on its token)."""
        ...

    def forget(self, request_id: str) -> None:
        """The request is gone: drop what is kept for it."""
        ...


class NgramProposer:
    """Prompt lookup (engine/spec_ngram.py) over each request's tokens, kept as numpy arrays."""

    def __init__(self, least: int, most: int) -> None:
        self.least, self.most = least, most
        self.arrays = TokenArrays()

    def propose(self, requests: list[Request], ks: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        arrays = [self.arrays.of(r.request_id, r.all_token_ids) for r in requests]
        return propose(arrays, ks, self.least, self.most), [None] * len(requests)

    def forget(self, request_id: str) -> None:
        self.arrays.forget(request_id)


class SpecDecoder:
    """Proposals, each request's running acceptance, and the counts. A request proposes one more
    token than it has lately had accepted (its running mean, from K at its start): a request
    whose proposals keep failing costs the step one token, not K."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None) -> None:
        """`proposer`: the draft model's (engine/spec_draft.py); None: n-gram's."""
        self.config = config
        self.max_model_len = max_model_len
        if proposer is None:
            if config.method != "ngram":
                raise ValueError(f"speculative method {config.method!r} needs its proposer")
            proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.proposer = proposer
        # this step's proposals' distributions (request id -> [k, V]), where not all on the token
        self.draft_probs: dict[str, torch.Tensor] = {}
        self.counts = SpecCounts(accepted_per_position=[0] * config.num_speculative_tokens)
        self.acceptance: dict[str, float] = {}  # request id -> running mean of its accepted proposals

    def budget(self, request_id: str) -> int:
        """How many tokens the request may propose: its running acceptance + 1, at most K."""
        k = self.config.num_speculative_tokens
        return max(1, min(k, round(self.acceptance.get(request_id, k)) + 1))

    def propose(self, running: list[Request]) -> dict[str, list[int]]:
        """Proposals for the running requests that speculate this step (id -> tokens)."""
        cfg = self.config
        self.draft_probs = {}
        decoding = [r for r in running if r.num_pending == 0 and r.num_computed_tokens == r.num_tokens - 1]
        if not decoding or len(decoding) > cfg.disable_by_batch_size:
            return {}
        chosen, ks = [], []
        for req in decoding:
            # room for the proposals and the token after them, under max_tokens and max_model_len
            k = min(self.budget(req.request_id), req.max_tokens - req.num_output_tokens - 1,
                    self.max_model_len - req.num_tokens - 1)  # fmt: skip
            if k > 0 and speculates(req):
                chosen.append(req)
                ks.append(k)
        if not chosen:
            return {}
        proposals, probs = self.proposer.propose(chosen, ks)
        for r, p, q in zip(chosen, proposals, probs):
            if p and q is not None:
                self.draft_probs[r.request_id] = q
        return {r.request_id: p for r, p in zip(chosen, proposals) if p}

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        before = self.acceptance.get(request_id, self.config.num_speculative_tokens)
        self.acceptance[request_id] = ACCEPTANCE_DECAY * before + (1 - ACCEPTANCE_DECAY) * num_accepted
        c = self.counts
        c.num_drafts += 1
        c.num_draft_tokens += num_drafts
        c.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            c.accepted_per_position[i] += 1

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)
        self.acceptance.pop(request_id, None)
