"""The plain sampler: each request's logits treated on their own, from its token lists.

The reference the batched sampler (sampler.py) is compared against: same order, same
arithmetic, one request at a time. Order: logit bias → penalties → min_tokens mask →
grammar mask → greedy argmax, or temperature → top-k → top-p → min-p → the exponential
race. Penalties read the request's output tokens on the host, so a step with penalties
cannot be scheduled before the previous step's tokens are read (`overlap_safe`).
"""

from __future__ import annotations

import torch

from llmserve.engine import seeded_noise
from llmserve.engine.argmax import row_argmax
from llmserve.engine.request import Request, TokenLogprobs
from llmserve.engine.sampler_output import PendingSample, SampledLogprobs
from llmserve.engine.structured_output import GrammarMask, apply_grammar_masks
from llmserve.host_copy import to_device
from llmserve.sampling_params import SamplingParams


class ReferenceSampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def forget(self, request_ids: list[str]) -> None:
        pass

    def overlap_safe(self, request: Request) -> bool:
        """May this request's next step be scheduled before its last token is known?"""
        return not request.has_grammar and not request.sampling_params.has_penalties

    def __call__(self, logits: torch.Tensor, requests: list[Request]):
        return self.sample_async(logits, requests).result()

    def sample_async(self, logits: torch.Tensor, requests: list[Request], grammar: GrammarMask | None = None,
                     ) -> PendingSample:  # fmt: skip
        logits = logits.float()
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self.penalties_and_masks(logits, requests, grammar)
        tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        for i, req in enumerate(requests):
            p = req.sampling_params
            row = logits[i : i + 1]
            tokens[i] = row.argmax(dim=-1)[0] if p.greedy else _sample_row(row, req)[0]
        logprobs = None
        if raw_logprobs is not None:
            logprobs = SampledLogprobs.ready([
                token_logprobs(raw_logprobs[i], int(tokens[i]), r.sampling_params.logprobs)
                if r.sampling_params.logprobs is not None else None for i, r in enumerate(requests)
            ])  # fmt: skip
        return PendingSample(tokens, logprobs)

    def penalties_and_masks(self, logits: torch.Tensor, requests: list[Request], grammar: GrammarMask | None = None,
                            ) -> torch.Tensor:  # fmt: skip
        for i, req in enumerate(requests):
            p = req.sampling_params
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
                logits[i].index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), device=logits.device))
            if p.has_penalties:
                logits[i] = apply_penalties(logits[i], req.prompt_token_ids, req.output_token_ids, p)
            if req.num_output_tokens < p.min_tokens and not req.has_grammar:  # a grammar decides its own end
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(req.eos_token_ids))
                if banned:
                    logits[i, banned] = float("-inf")
        apply_grammar_masks(logits, requests, grammar)  # last: what the grammar allows is all there is
        return logits


def _sample_row(row: torch.Tensor, req: Request) -> torch.Tensor:
    p = req.sampling_params
    temperature = torch.tensor([[p.temperature]], dtype=torch.float32, device=row.device)
    row = apply_top_k_top_p_min_p(row / temperature, [p.top_k], [p.top_p], [p.min_p])
    if p.seed is None:
        noise = torch.empty_like(row).exponential_()
    else:
        keys = torch.tensor([seeded_noise.row_key(p.seed, req.num_output_tokens)], device=row.device)
        noise = seeded_noise.exponential(keys, torch.arange(row.shape[-1], device=row.device))
    return exponential_race(row, noise)


def exponential_race(logits: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Each row's winner of the exponential race: argmax of softmax(logits) / noise, with noise
    ~ Exp(1) (exact categorical sampling). Ranked as logits - log(noise), the same order in exact
    arithmetic (softmax is exp(logits - c) with one c a row, and exp and log are increasing), so no
    softmax over the vocabulary is computed. Tokens masked to -inf never win."""
    return row_argmax(logits - noise.log())


def apply_penalties(
    logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int], p: SamplingParams
) -> torch.Tensor:
    """Repetition penalty over prompt and output (as transformers); presence and frequency
    penalties over the output (as OpenAI)."""
    logits = logits.clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), device=logits.device)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if output_ids and (p.presence_penalty or p.frequency_penalty):
        counts = torch.bincount(torch.tensor(output_ids, device=logits.device), minlength=logits.shape[-1]).to(
            logits.dtype
        )
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def mass_above(sorted_logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Each token's mass strictly above it, of rows sorted best first (`probs`: their
    probabilities): top-p keeps a token when this is at most top_p. Tokens of equal logit share
    their first one's, so a tie is kept or dropped whole, whatever order the sort gave it."""
    before = probs.cumsum(dim=-1) - probs
    first = torch.ones_like(sorted_logits, dtype=torch.bool)
    first[..., 1:] = sorted_logits[..., 1:] != sorted_logits[..., :-1]
    return torch.where(first, before, 0.0).cummax(dim=-1).values  # (`before` grows along a row)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]
) -> torch.Tensor:
    """Mask logits outside each row's top-k, nucleus top-p (`mass_above`) and min-p sets with
    -inf (a sort of the whole vocabulary)."""
    use_k = any(k > 0 for k in top_k)
    use_p = any(p < 1.0 for p in top_p)
    if use_k or use_p:
        vocab = logits.shape[-1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        if use_k:
            k = to_device([k if k > 0 else vocab for k in top_k], torch.long, logits.device)
            ranks = torch.arange(vocab, device=logits.device)[None, :]
            sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
        if use_p:
            p = to_device(top_p, logits.dtype, logits.device)
            before = mass_above(sorted_logits, torch.softmax(sorted_logits, dim=-1))
            sorted_logits = sorted_logits.masked_fill(before > p[:, None], float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    if any(m > 0.0 for m in min_p):
        m = to_device(min_p, logits.dtype, logits.device)
        probs = torch.softmax(logits, dim=-1)
        threshold = m[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def token_logprobs(row: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """A token's logprob and rank in a log-softmax row, and the row's top k."""
    token_lp = row[token]
    rank = int((row > token_lp).sum().item()) + 1
    top: list[tuple[int, float]] = []
    if k > 0:
        values, ids = row.topk(k)
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprobs(float(token_lp.item()), rank, top)
