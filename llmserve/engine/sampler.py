"""Turn the logits of the rows that sample into tokens, the whole batch at once.

Order (as the reference, sampler_reference.py, which treats one request at a time):
logit bias → penalties → min_tokens mask → grammar mask → greedy argmax, or temperature →
top-k → top-p → min-p → the exponential race (argmax of p / E with E ~ Exp(1), exact
categorical sampling, ranked as logits - log E: no softmax over the vocabulary). Every step
is a few tensor operations over the batch: per-request settings travel as one small
host-to-device copy each, penalty counts live on the device (penalty_state.py) and grow
from the sampled tokens there, a seeded request's noise is a hash of (seed, position,
token) (seeded_noise.py). Nothing waits for the device, so a step with penalties can be
scheduled before the previous step's tokens are read.

A batch's random rows go by groups (`_groups`). Rows with a top-k of at most TOPK_FAST race
over their k best candidates only (torch.topk instead of a sort of the whole vocabulary); it
picks the token the full race would (every other token has probability 0, and a seeded row's
noise at a token does not depend on which tokens are raced). On a GPU, rows with a temperature
alone take one kernel pass (kernels/sampling.py), and rows without a top-k race over their
top-p / min-p set in a kernel of about two passes, seeded rows included (kernels/filtered_race.py). Logprobs are the model's raw
log-softmax, as vLLM reports them; on a GPU one kernel pass over the asked rows' logits gives them
with no log-softmax of the batch written (kernels/logprob_stats.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from operator import attrgetter

import torch

from llmserve.engine import seeded_noise
from llmserve.engine.argmax import row_argmax
from llmserve.engine.penalty_state import PenaltyRows, PenaltyState
from llmserve.engine.request import Request
from llmserve.engine.sampler_output import PendingSample, SampledLogprobs, SamplerOutput
from llmserve.engine.sampler_reference import apply_top_k_top_p_min_p, exponential_race, mass_above
from llmserve.engine.structured_output import GrammarMask, apply_grammar_masks
from llmserve.host_copy import kept_on_device, to_device

TOPK_FAST = 1024  # rows whose top_k is at most this race only their top-k candidates
# logprobs of at most this many top tokens take the one-pass kernel over the raw logits (it runs k
# rounds a block: at k = 20 slower than rank and topk by tensor ops, at 5 faster than either, a fifth
# of its time at 20; docs/history/benchmarks.md); it runs 1 round (k = 1) or this many
STATS_MAX_K = 8

__all__ = ["PendingSample", "Sampler", "SamplerOutput", "TOPK_FAST"]


@dataclass(slots=True)
class _Random:
    """The rows that sample at random, and their settings."""

    rows: list[int]
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    min_p: list[float]
    seeded: list[int]  # positions within `rows`
    keys: list[tuple[int, int]]  # seeded_noise.row_key of each seeded row
    # the lists but `keys` on the device (`kept_on_device`); shared by the copies `replace` makes with
    # each step's keys, so `keys` must never be kept there
    copies: dict[str, torch.Tensor] = field(default_factory=dict)
    groups: list[tuple[str, _Random]] | None = None  # `_groups`, made on first use

    @property
    def slots(self) -> list[int]:
        """Each row's index among the seeded rows (their keys), -1 for an unseeded row."""
        out = [-1] * len(self.rows)
        for n, j in enumerate(self.seeded):
            out[j] = n
        return out


@dataclass(slots=True)
class _LogprobRows:
    """The rows that ask for logprobs, and how many top tokens each shows."""

    rows: list[int]
    ks: list[int]
    copies: dict[str, torch.Tensor] = field(default_factory=dict)  # `rows` on the device (`kept_on_device`)

    @property
    def k(self) -> int:
        return max(max(self.ks), 1)


@dataclass(slots=True)
class _Plan:
    """What a batch's sampling settings say, made once and kept while the batch holds the same
    requests in the same order (decode steps mostly do): no loop over the batch's requests on
    such a step. What changes from step to step is read then, for the rows it concerns: the
    output counts of rows with a min_tokens or a seed."""

    key: tuple[str, ...]  # the requests' ids, in batch order
    greedy: bool  # every row greedy, without logprobs, penalties, logit bias or grammar
    min_tokens_rows: list[int]  # rows with a min_tokens
    bias_rows: list[int]  # rows with a logit bias
    logprobs: _LogprobRows | None  # the rows that ask for logprobs
    penalties: PenaltyRows | None
    random: _Random  # without keys (a seeded row's key follows its output count)
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = (
        None  # the logit bias's (rows, token ids, values) on the device, made on first use
    )


_request_id = attrgetter("request_id")


class Sampler:
    def __init__(self, device: torch.device, vocab_size: int | None = None, use_kernels: bool = False) -> None:
        """`use_kernels`: the penalties and the plain race as Triton kernels (one pass each over
        the vocabulary, llmserve/kernels/sampling.py), as on a GPU; off: tensor ops."""
        self.device = device
        self.vocab_size = vocab_size
        self.use_kernels = use_kernels
        self.penalties: PenaltyState | None = None
        self._plan: _Plan | None = None  # the last batch's

    def forget(self, request_ids: list[str]) -> None:
        if request_ids:
            self._plan = None
        if self.penalties is not None:
            self.penalties.release(request_ids)

    def overlap_safe(self, request: Request) -> bool:
        """May this request's next step be scheduled before its last token is known? Yes,
        but for a grammar's: its mask needs the previous token."""
        return not request.has_grammar

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        return self.sample_async(logits, requests).result()

    def sample_async(self, logits: torch.Tensor, requests: list[Request], grammar: GrammarMask | None = None,
                     ) -> PendingSample:  # fmt: skip
        """Queue the sampling work; `.result()` waits for the tokens. Between the two the
        host is free for other work while the device computes. `requests`: `Request`s or the
        runner's `RunnerRequest`s (the same fields); `grammar`: the rows' grammar mask, filled
        on the core side (None: from the requests' own matchers, if they have any)."""
        plan = self._plan_for(logits, requests)
        if grammar is None and plan.greedy and not _short_of_min_tokens(requests, plan.min_tokens_rows):
            return PendingSample(
                row_argmax(logits), None
            )  # argmax of the 16-bit logits: .float() is exact, the same winner
        asked, raw = plan.logprobs, None
        fused = asked is not None and self.use_kernels and asked.k <= STATS_MAX_K
        if fused:  # the kernel reads the model's logits after sampling: kept as they are
            raw = logits.clone() if logits.dtype == torch.float32 else logits
        logits = logits.float()
        if asked is not None and not fused:
            raw = torch.log_softmax(logits, dim=-1)
        pen = plan.penalties
        logits = self.penalties_and_masks(logits, requests, pen, grammar, plan)
        random = plan.random
        if not random.rows:
            tokens = row_argmax(logits)
        else:
            groups = random.groups
            if groups is None:
                groups = random.groups = _groups(random, self.use_kernels)
            tokens = None
            if len(random.rows) < len(requests):
                tokens = row_argmax(logits)
            elif len(groups) > 1:
                tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
            for path, group in groups:
                if group.seeded:
                    group = replace(group, keys=_seeded_keys(requests, group))
                picked = self._sample(logits, group, path)
                if tokens is None:
                    tokens = picked
                else:
                    tokens[kept_on_device(group, "rows", torch.long, logits.device)] = picked
        if pen is not None:
            self.penalties.count(tokens, pen)
        logprobs = None
        if asked is not None:
            logprobs = _fused_logprobs(raw, tokens, asked) if fused else _logprobs(raw, tokens, asked)
        return PendingSample(tokens, logprobs)

    def _plan_for(self, logits: torch.Tensor, requests: list[Request]) -> _Plan:
        """The batch's plan: the last one while the requests and their order are the same."""
        key = tuple(map(_request_id, requests))
        plan = self._plan
        if plan is not None and plan.key == key:
            return plan
        rows = list(enumerate(requests))
        self._plan = plan = _Plan(
            key, _plain_greedy(requests),
            [i for i, r in rows if r.sampling_params.min_tokens > 0], [i for i, r in rows if r.sampling_params.logit_bias],
            _logprob_rows(requests), self._penalty_rows(logits, requests),
            _random_rows(requests),
        )  # fmt: skip
        return plan

    def _penalty_rows(self, logits: torch.Tensor, requests: list[Request]) -> PenaltyRows | None:
        if not any(r.sampling_params.has_penalties for r in requests):
            return None
        if self.penalties is None:
            self.penalties = PenaltyState(
                self.vocab_size or logits.shape[-1], logits.device, use_kernel=self.use_kernels
            )
        return self.penalties.rows_for(requests)

    def penalties_and_masks(self, logits: torch.Tensor, requests: list[Request], pen: PenaltyRows | None = None,
                            grammar: GrammarMask | None = None, plan: _Plan | None = None) -> torch.Tensor:  # fmt: skip
        """`plan`: the batch's (`_plan_for`), naming the rows with a logit bias or min_tokens (None: every row looked at)."""
        self._logit_bias(logits, requests, plan)
        if pen is not None:
            logits = self.penalties.apply(logits, pen)
        _min_tokens(logits, requests, None if plan is None else plan.min_tokens_rows)
        apply_grammar_masks(logits, requests, grammar)  # last: what the grammar allows is all there is
        return logits

    def _logit_bias(self, logits: torch.Tensor, requests: list[Request], plan: _Plan | None = None) -> None:
        """Each row's logit bias added to its tokens; with a plan, its tensors are made once while the batch lasts."""
        if plan is None:
            bias = _bias_tensors(requests, range(len(requests)), logits.device)
        elif not plan.bias_rows:
            return
        else:
            if plan.bias is None:
                plan.bias = _bias_tensors(requests, plan.bias_rows, logits.device)
            bias = plan.bias
        if bias is not None:
            rows, ids, values = bias
            logits.index_put_((rows, ids), values, accumulate=True)

    def _sample(self, logits: torch.Tensor, r: _Random, path: str) -> torch.Tensor:
        """The tokens of the rows `r` (a group of `_groups`) by `path`."""
        device = logits.device
        rows = kept_on_device(r, "rows", torch.long, device) if len(r.rows) < logits.shape[0] else None
        temperature = (
            kept_on_device(r, "temperature", torch.float32, device) if any(t != 1.0 for t in r.temperature) else None
        )
        if path == "race":  # temperature alone, no seed: one kernel over the vocabulary
            from llmserve.kernels.sampling import race

            return race(logits, rows, temperature)
        if path == "filtered":  # top-p, min-p, seeds, no top-k: a few passes, no sort
            from llmserve.kernels.filtered_race import filtered_race

            slots = keys = None
            if r.seeded:
                slots = kept_on_device(r, "slots", torch.int32, device)
                keys = to_device(r.keys, torch.long, device)
            top_p = kept_on_device(r, "top_p", torch.float32, device)
            return filtered_race(logits, rows, temperature, top_p, kept_on_device(r, "min_p", torch.float32, device),
                                 slots, keys)  # fmt: skip
        part = logits if rows is None else logits[rows]  # (every row samples: no gather)
        if temperature is not None:  # (x / 1.0 is x: no division; a tensor, as the reference divides)
            part = part / temperature[:, None]
        if path == "top_k":
            return self._sample_top_k(part, r)
        part = apply_top_k_top_p_min_p(part, r.top_k, r.top_p, r.min_p)
        noise = torch.empty_like(part).exponential_()
        if r.seeded:
            seeded = kept_on_device(r, "seeded", torch.long, device)
            keys = to_device(r.keys, torch.long, device)
            noise[seeded] = seeded_noise.exponential(keys, torch.arange(part.shape[-1], device=device))
        return exponential_race(part, noise)

    def _sample_top_k(self, part: torch.Tensor, r: _Random) -> torch.Tensor:
        """Race the k best candidates of each row (k = its top_k), masked as the full path masks."""
        device = part.device
        values, ids = part.topk(max(r.top_k), dim=-1)  # sorted, best first
        ranks = torch.arange(values.shape[-1], device=device)[None, :]
        values = values.masked_fill(ranks >= kept_on_device(r, "top_k", torch.long, device)[:, None], float("-inf"))
        if any(p < 1.0 for p in r.top_p):
            before = mass_above(values, torch.softmax(values, dim=-1))
            values = values.masked_fill(
                before > kept_on_device(r, "top_p", torch.float32, device)[:, None], float("-inf")
            )
        if any(m > 0.0 for m in r.min_p):
            probs = torch.softmax(values, dim=-1)
            threshold = (
                kept_on_device(r, "min_p", torch.float32, device)[:, None] * probs.max(dim=-1, keepdim=True).values
            )
            values = values.masked_fill(probs < threshold, float("-inf"))
        noise = torch.empty_like(values).exponential_()
        if r.seeded:
            seeded = kept_on_device(r, "seeded", torch.long, device)
            noise[seeded] = seeded_noise.exponential(to_device(r.keys, torch.long, device), ids[seeded])
        choice = exponential_race(values, noise)
        return ids.gather(-1, choice[:, None]).squeeze(-1)


def _plain_greedy(requests: list[Request]) -> bool:
    """Is every row greedy, without logprobs, penalties, logit bias or grammar? (Whether a
    min_tokens mask or a step's grammar mask applies is read per step, `sample_async`.)"""
    for req in requests:
        p = req.sampling_params
        if not p.greedy or p.logprobs is not None or p.has_penalties or p.logit_bias or req.has_grammar:
            return False
    return True


def _short_of_min_tokens(requests: list[Request], rows: list[int]) -> bool:
    return any(requests[i].num_output_tokens < requests[i].sampling_params.min_tokens for i in rows)


def _seeded_keys(requests: list[Request], r: _Random) -> list[tuple[int, int]]:
    """This step's noise keys of the seeded rows (seeded_noise.row_key: seed and output count)."""
    out = []
    for j in r.seeded:
        req = requests[r.rows[j]]
        out.append(seeded_noise.row_key(req.sampling_params.seed, req.num_output_tokens))
    return out


def _plain_race(r: _Random) -> bool:
    """No row with a seed (its noise is a hash, seeded_noise.py), a top-k, top-p or min-p."""
    return not r.seeded and all(k <= 0 for k in r.top_k) and all(p >= 1.0 for p in r.top_p) and not any(r.min_p)


def _groups(r: _Random, use_kernels: bool) -> list[tuple[str, _Random]]:
    """The random rows by the path that samples them, each group a `_Random` over its rows:
    "race" (every row has a temperature alone: one kernel), "top_k" (a top-k of at most
    TOPK_FAST: the race over the k best), "filtered" (no top-k: the kernel that races over the
    top-p and min-p set, `filtered_race.py`), "sort" (the rest, and the rows without a top-k
    when there are no kernels: a sort of the vocabulary, as the reference)."""
    if use_kernels and _plain_race(r):
        return [("race", r)]
    paths: dict[str, list[int]] = {}
    for j, k in enumerate(r.top_k):
        path = "top_k" if 0 < k <= TOPK_FAST else "sort" if k > 0 or not use_kernels else "filtered"
        paths.setdefault(path, []).append(j)
    if len(paths) == 1:
        return [(next(iter(paths)), r)]
    return [(path, _subset(r, js)) for path, js in paths.items()]


def _subset(r: _Random, js: list[int]) -> _Random:
    """The rows at positions `js` of `r`, as a `_Random` of their own (its keys left empty)."""
    where = {j: n for n, j in enumerate(js)}
    return _Random([r.rows[j] for j in js], [r.temperature[j] for j in js], [r.top_k[j] for j in js],
                   [r.top_p[j] for j in js], [r.min_p[j] for j in js], [where[j] for j in r.seeded if j in where], [])  # fmt: skip


def _random_rows(requests: list[Request]) -> _Random:
    """The rows that sample at random and their settings; the seeded rows' noise keys are left
    empty (they follow the output count: `_seeded_keys` makes them each step)."""
    r = _Random([], [], [], [], [], [], [])
    for i, req in enumerate(requests):
        p = req.sampling_params
        if p.greedy:
            continue
        if p.seed is not None:
            r.seeded.append(len(r.rows))
        r.rows.append(i)
        r.temperature.append(p.temperature)
        r.top_k.append(p.top_k)
        r.top_p.append(p.top_p)
        r.min_p.append(p.min_p)
    return r


def _bias_tensors(
    requests: list[Request], among, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The logit biases of the rows `among` as (row index, token id, value), one entry per biased token."""
    rows: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for i in among:
        bias = requests[i].sampling_params.logit_bias
        if bias:
            rows.extend([i] * len(bias))
            ids.extend(bias)
            values.extend(bias.values())
    if not rows:
        return None
    return (
        to_device(rows, torch.long, device),
        to_device(ids, torch.long, device),
        to_device(values, torch.float32, device),
    )


def _min_tokens(logits: torch.Tensor, requests: list[Request], among: list[int] | None = None) -> None:
    """Requests short of min_tokens may not end yet: their stop and EOS tokens masked (`among`:
    the rows that may be, None: every row)."""
    rows: list[int] = []
    ids: list[int] = []
    for i in range(len(requests)) if among is None else among:
        req = requests[i]
        p = req.sampling_params
        if req.num_output_tokens < p.min_tokens and not req.has_grammar:  # a grammar decides its own end
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(req.eos_token_ids))
            rows.extend([i] * len(banned))
            ids.extend(banned)
    if rows:
        logits[to_device(rows, torch.long, logits.device), to_device(ids, torch.long, logits.device)] = float("-inf")


def _logprob_rows(requests: list[Request]) -> _LogprobRows | None:
    rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    return _LogprobRows(rows, [requests[i].sampling_params.logprobs for i in rows]) if rows else None


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, asked: _LogprobRows) -> SampledLogprobs:
    """From the batch's log-softmax `raw`: the sampled token's logprob and rank (1 + how many
    logprobs are larger) and the top k of every row that asked, by tensor ops."""
    if len(asked.rows) == raw.shape[0]:  # every row asked: no copy of the rows
        part, picked = raw, tokens
    else:
        index = kept_on_device(asked, "rows", torch.long, raw.device)
        part, picked = raw[index], tokens[index]
    token_lp = part.gather(-1, picked[:, None])
    rank = (part > token_lp).sum(dim=-1) + 1
    values, ids = part.topk(asked.k, dim=-1)
    return SampledLogprobs(asked.rows, asked.ks, token_lp.squeeze(-1), rank, values, ids)


def raw_logprobs(logits: torch.Tensor, tokens: torch.Tensor, ks: list[int], use_kernels: bool) -> SampledLogprobs:
    """Logprobs of `tokens` (one a row) in the model's own `logits`, as the sampler reports a
    sampled token's: its logprob and rank and the top `ks[i]` of row i (the prompt logprobs'
    path, engine/prompt_logprobs.py). On a GPU up to STATS_MAX_K by the one-pass kernel."""
    asked = _LogprobRows(list(range(len(ks))), ks)
    if use_kernels and asked.k <= STATS_MAX_K:
        return _fused_logprobs(logits, tokens, asked)
    return _logprobs(torch.log_softmax(logits.float(), dim=-1), tokens, asked)


def _fused_logprobs(logits: torch.Tensor, tokens: torch.Tensor, asked: _LogprobRows) -> SampledLogprobs:
    """The same from the model's logits, the asked rows only, in one kernel pass with no
    log-softmax written (llmserve/kernels/logprob_stats.py; ranks by the logits' order)."""
    from llmserve.kernels.logprob_stats import logprob_stats

    index = kept_on_device(asked, "rows", torch.long, logits.device)  # (always: one kernel variant to compile)
    if len(asked.rows) < logits.shape[0]:
        tokens = tokens[index]
    token_lp, rank, values, ids = logprob_stats(logits, tokens, _stats_width(asked.k), index)
    return SampledLogprobs(asked.rows, asked.ks, token_lp, rank, values[:, : asked.k], ids[:, : asked.k])


def _stats_width(k: int) -> int:
    """The kernel's k: 1 or STATS_MAX_K, two variants to compile (the warm-up's) rather than one per k."""
    return 1 if k == 1 else STATS_MAX_K
