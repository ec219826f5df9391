"""Turn the logits of the rows that sample into tokens.

Order: penalties → min_tokens mask → greedy argmax, or temperature → top-k → top-p →
min-p → sample. Random rows sample by the exponential race (argmax of p / E with E ~
Exp(1)), which is exact categorical sampling; a seeded request draws its E from its own
generator, so its tokens do not depend on what else is in the batch. Logprobs are the
model's raw log-softmax, as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.engine.host_copy import to_device
from llmserve.engine.request import Request, TokenLogprobs
from llmserve.engine.structured_output import apply_grammar_masks
from llmserve.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class PendingSample:
    """Sampled tokens still on their way from the device."""

    def __init__(self, tokens: torch.Tensor, raw_logprobs: torch.Tensor | None, requests: list[Request]) -> None:
        self.raw_logprobs = raw_logprobs
        self.requests = requests
        self.device_tokens = tokens  # read by the next step before the host has them
        self.event = None
        if tokens.is_cuda:
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tokens

    def result(self) -> SamplerOutput:
        if self.event is not None:
            self.event.synchronize()
        token_list = self.host.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(self.requests)
        if self.raw_logprobs is not None:
            for i, req in enumerate(self.requests):
                k = req.sampling_params.logprobs
                if k is not None:
                    logprobs[i] = _token_logprobs(self.raw_logprobs[i], token_list[i], k)
        return SamplerOutput(token_list, logprobs)


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        return self.sample_async(logits, requests).result()

    def sample_async(self, logits: torch.Tensor, requests: list[Request]) -> "PendingSample":
        """Queue the sampling work; `.result()` waits for the tokens. Between the two the
        host is free for other work while the device computes."""
        logits = logits.float()
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_penalties_and_masks(logits, requests)
        greedy = [i for i, r in enumerate(requests) if r.sampling_params.greedy]
        if len(greedy) == len(requests):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
            random = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
            if greedy:
                idx = to_device(greedy, torch.long, logits.device)
                tokens[idx] = logits[idx].argmax(dim=-1)
            idx = to_device(random, torch.long, logits.device)
            tokens[idx] = self._sample(logits[idx], [requests[i] for i in random])
        return PendingSample(tokens, raw_logprobs, requests)

    def _apply_penalties_and_masks(
        self, logits: torch.Tensor, requests: list[Request]
    ) -> torch.Tensor:
        for i, req in enumerate(requests):
            p = req.sampling_params
            if p.logit_bias:
                if req.logit_bias is None:  # built once per request, kept on the device
                    req.logit_bias = (to_device(list(p.logit_bias), torch.long, logits.device),
                                      to_device(list(p.logit_bias.values()), logits.dtype, logits.device))  # fmt: skip
                logits[i].index_add_(0, *req.logit_bias)
            if p.has_penalties:
                logits[i] = apply_penalties(logits[i], req.prompt_token_ids, req.output_token_ids, p)
            if req.num_output_tokens < p.min_tokens and req.matcher is None:  # a grammar decides its own end
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(req.eos_token_ids))
                if banned:
                    logits[i, banned] = float("-inf")
        apply_grammar_masks(logits, requests)  # last: what the grammar allows is all there is
        return logits

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        temps = to_device([r.sampling_params.temperature for r in requests], torch.float32, logits.device)
        logits = logits / temps[:, None]
        logits = apply_top_k_top_p_min_p(
            logits,
            [r.sampling_params.top_k for r in requests],
            [r.sampling_params.top_p for r in requests],
            [r.sampling_params.min_p for r in requests],
        )
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        unseeded = []
        for i, req in enumerate(requests):
            gen = self._generator(req)
            if gen is None:
                unseeded.append(i)
            else:
                noise[i].exponential_(generator=gen)
        if unseeded:
            idx = to_device(unseeded, torch.long, logits.device)
            noise[idx] = torch.empty_like(noise[idx]).exponential_()
        return (probs / noise).argmax(dim=-1)

    def _generator(self, req: Request) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is None:
            return None
        gen = self.generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            self.generators[req.request_id] = gen
        return gen


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
            logits[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
    if output_ids and (p.presence_penalty or p.frequency_penalty):
        counts = torch.bincount(
            torch.tensor(output_ids, device=logits.device), minlength=logits.shape[-1]
        ).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]
) -> torch.Tensor:
    """Mask logits outside each row's top-k, nucleus top-p and min-p sets with -inf."""
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
            probs = torch.softmax(sorted_logits, dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
            sorted_logits = sorted_logits.masked_fill(before > p[:, None], float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    if any(m > 0.0 for m in min_p):
        m = to_device(min_p, logits.dtype, logits.device)
        probs = torch.softmax(logits, dim=-1)
        threshold = m[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _token_logprobs(row: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    token_lp = row[token]
    rank = int((row > token_lp).sum().item()) + 1
    top: list[tuple[int, float]] = []
    if k > 0:
        values, ids = row.topk(k)
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprobs(float(token_lp.item()), rank, top)
