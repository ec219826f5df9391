"""Sampler: each optimized masking step against a plain per-row reference."""

from __future__ import annotations

import torch

from llmserve.engine.request import EngineCoreRequest, Request
from llmserve.engine.sampler import Sampler, apply_penalties, apply_top_k_top_p_min_p
from llmserve.sampling_params import SamplingParams


def reference_filter(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row, the obvious way: keep a set of token ids, mask the rest."""
    order = sorted(range(len(row)), key=lambda i: -row[i].item())
    keep = order[:top_k] if top_k > 0 else order
    probs = torch.softmax(row, dim=-1)
    if top_p < 1.0:
        total, kept = 0.0, []
        sub = torch.softmax(row[keep], dim=-1)
        for i, tok in enumerate(keep):
            if total > top_p:
                break
            kept.append(tok)
            total += sub[i].item()
        keep = kept
    out = torch.full_like(row, float("-inf"))
    out[keep] = row[keep]
    if min_p > 0:
        probs = torch.softmax(out, dim=-1)
        out[probs < min_p * probs.max()] = float("-inf")
    return out


def test_top_k_top_p_min_p_match_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen) * 3
    top_k, top_p, min_p = [0, 5, 0, 10, 3, 0], [1.0, 1.0, 0.7, 0.5, 0.9, 1.0], [0, 0, 0, 0.1, 0, 0.2]
    got = apply_top_k_top_p_min_p(logits.clone(), top_k, top_p, min_p)
    for i in range(6):
        want = reference_filter(logits[i], top_k[i], top_p[i], min_p[i])
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), f"row {i}"


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    p = SamplingParams(repetition_penalty=2.0)
    out = apply_penalties(logits, [0], [1], p)
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [0], [2, 2, 3], p)
    assert out.tolist() == [2.0, -2.0, 1.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25]


def _req(rid: str, **params) -> Request:
    return Request(EngineCoreRequest(rid, [1, 2, 3], SamplingParams(**params), 16, (2,)))


def test_seeded_rows_independent_of_batch():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(1))
    alone = Sampler(torch.device("cpu"))
    batch = Sampler(torch.device("cpu"))
    seq_alone, seq_batch = [], []
    for _ in range(20):
        seq_alone.append(alone(logits[2:3].clone(), [_req("s", seed=42)]).token_ids[0])
        reqs = [_req("x"), _req("y", temperature=0), _req("s", seed=42), _req("z", top_k=3), _req("w")]
        seq_batch.append(batch(logits.clone(), reqs).token_ids[2])
    assert seq_alone == seq_batch
    assert len(set(seq_alone)) > 1  # it really samples


def test_greedy_and_min_tokens_and_logprobs():
    logits = torch.tensor([[0.0, 0.0, 5.0, 1.0]])  # EOS (2) is the argmax
    sampler = Sampler(torch.device("cpu"))
    assert sampler(logits.clone(), [_req("a", temperature=0)]).token_ids == [2]
    out = sampler(logits.clone(), [_req("b", temperature=0, min_tokens=1, logprobs=2)])
    assert out.token_ids == [3]  # EOS masked until min_tokens
    lp = out.logprobs[0]
    assert lp.token_rank == 2  # raw logprobs: EOS still ranks first
    assert [t for t, _ in lp.top] == [2, 3]
    assert abs(lp.token_logprob - torch.log_softmax(logits[0], -1)[3].item()) < 1e-6


def test_sampling_follows_distribution():
    probs = torch.tensor([0.1, 0.2, 0.7])
    logits = probs.log().repeat(4000, 1)
    sampler = Sampler(torch.device("cpu"))
    tokens = sampler(logits, [_req(str(i)) for i in range(4000)]).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_logit_bias_is_added_to_its_tokens_only():
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0], [0.0, 1.0, 5.0, 2.0]])
    sampler = Sampler(torch.device("cpu"))
    reqs = [_req("a", temperature=0, logit_bias={3: 3.5, 0: -1.0}), _req("b", temperature=0)]
    biased = sampler._apply_penalties_and_masks(logits.clone(), reqs)
    assert biased[0].tolist() == [-1.0, 1.0, 5.0, 5.5] and biased[1].tolist() == logits[1].tolist()
    assert sampler(logits.clone(), reqs).token_ids == [3, 2]
    assert sampler(logits[:1].clone(), [_req("c", temperature=0, logit_bias={2: -100})]).token_ids == [3]
    for bad in ({-1: 1.0}, {1: 101.0}, {True: 1.0}, {"1": 1.0}):
        try:
            SamplingParams(logit_bias=bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} accepted")
