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
the target's distribution exactly: proposal i is accepted with the target's probability of it
(the n-gram proposer's own distribution is all on that token); at the first rejection the token
is drawn from the target's distribution without the proposal, renormalised; after K accepted, a
bonus token from the last position's. A seeded request draws its noise from (seed, output
position), as the sampler does, so it reproduces.

Who speculates: requests without penalties, logit bias, a grammar, or an unmet min_tokens (the sampler would change the target's distribution), while at most
`disable_by_batch_size` sequences decode (a larger batch is compute-bound: verifying K more
tokens each would cost it throughput). The others decode one token a step beside them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


def rejection_sample(filtered: torch.Tensor, drafts: torch.Tensor, uniform: torch.Tensor,
                     noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """A sampled request's verification on the device: `filtered` [K + 1, V] its target logits after
    temperature and top-k/top-p/min-p (-inf outside), `drafts` [K], `uniform` [K] in (0, 1) and
    `noise` [K + 1, V] Exp(1). Returns (accepted [K] bools, the token drawn at each of the first K
    positions from the target without its proposal [K], the bonus token [1]); `kept_tokens` reads them."""
    k = drafts.shape[0]
    probs = torch.softmax(filtered.float(), dim=-1)
    accepted = uniform < probs[:k].gather(1, drafts[:, None])[:, 0]
    residual = probs[:k].scatter(1, drafts[:, None], 0.0)  # the target less the proposal (q is all on it)
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


class SpecDecoder:
    """Proposals, each request's running acceptance, and the counts. A request proposes one more
    token than it has lately had accepted (its running mean, from K at its start): a request
    whose proposals keep failing costs the step one token, not K."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.arrays = TokenArrays()
        self.counts = SpecCounts(accepted_per_position=[0] * config.num_speculative_tokens)
        self.acceptance: dict[str, float] = {}  # request id -> running mean of its accepted proposals

    def budget(self, request_id: str) -> int:
        """How many tokens the request may propose: its running acceptance + 1, at most K."""
        k = self.config.num_speculative_tokens
        return max(1, min(k, round(self.acceptance.get(request_id, k)) + 1))

    def propose(self, running: list[Request]) -> dict[str, list[int]]:
        """Proposals for the running requests that speculate this step (id -> tokens)."""
        cfg = self.config
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
        arrays = [self.arrays.of(r.request_id, r.all_token_ids) for r in chosen]
        proposals = propose(arrays, ks, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
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
        self.arrays.forget(request_id)
        self.acceptance.pop(request_id, None)
