"""Sampler: the batched sampler against the one-request-at-a-time reference, and each
masking step against a plain per-row reference."""

from __future__ import annotations

import pytest
import torch

from llmserve.engine.request import EngineCoreRequest, Request
from llmserve.engine.sampler import Sampler
from llmserve.engine.sampler_reference import ReferenceSampler, apply_penalties, apply_top_k_top_p_min_p
from llmserve.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


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
    solo, mate = _req("s", seed=42), _req("s", seed=42)  # the same request, sampled alone and in a batch
    for _ in range(20):
        seq_alone.append(alone(logits[2:3].clone(), [solo]).token_ids[0])
        reqs = [_req("x"), _req("y", temperature=0), mate, _req("z", top_k=3), _req("w")]
        seq_batch.append(batch(logits.clone(), reqs).token_ids[2])
        solo.all_token_ids.append(seq_alone[-1])  # the next token is the next position's draw
        mate.all_token_ids.append(seq_batch[-1])
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
    biased = sampler.penalties_and_masks(logits.clone(), reqs)
    assert biased[0].tolist() == [-1.0, 1.0, 5.0, 5.5] and biased[1].tolist() == logits[1].tolist()
    assert sampler(logits.clone(), reqs).token_ids == [3, 2]
    assert sampler(logits[:1].clone(), [_req("c", temperature=0, logit_bias={2: -100})]).token_ids == [3]
    for bad in ({-1: 1.0}, {1: 101.0}, {True: 1.0}, {"1": 1.0}):
        try:
            SamplingParams(logit_bias=bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} accepted")


# -- the batched sampler against the reference, step after step ---------------------------
MIXED = [
    dict(temperature=0),
    dict(temperature=0, repetition_penalty=1.3),
    dict(temperature=0.8, seed=11, presence_penalty=0.5),
    dict(temperature=0.8, seed=12, top_p=0.9, top_k=50),  # the top-k path (when all rows have a top_k)
    dict(temperature=1.0, seed=13, frequency_penalty=0.4, presence_penalty=0.2, repetition_penalty=1.1),
    dict(temperature=0.7, seed=14, min_p=0.05, logit_bias={5: 2.0, 9: -3.0}),
    dict(temperature=0, logit_bias={7: 1.5}, min_tokens=4),
    dict(temperature=1.2, seed=2**64 - 1, top_k=3, repetition_penalty=0.8),
    dict(temperature=0.9, seed=15, top_p=0.3),  # top-p alone (with kernels: filtered_race.py)
    dict(temperature=1.1, seed=16, top_p=0.6, min_p=0.1, frequency_penalty=0.3),
    dict(temperature=0.9, seed=17, top_k=2000, top_p=0.7),  # a top-k past TOPK_FAST: the sort
]


def _requests(specs: list[dict], prompt_seed: int = 0) -> list[Request]:
    gen = torch.Generator().manual_seed(prompt_seed)
    out = []
    for i, spec in enumerate(specs):
        prompt = torch.randint(0, 60, (4 + 3 * i,), generator=gen).tolist()
        out.append(Request(EngineCoreRequest(f"r{i}", prompt, SamplingParams(max_tokens=64, **spec), 64, (2, 3))))
    return out


def _run_steps(sampler, specs: list[dict], steps: int, vocab: int = 64, logprobs: bool = False) -> list[list]:
    """Sample `steps` tokens for each request, appending each to its output as the scheduler does;
    the logits of a step are the same for both samplers (a fixed generator)."""
    if logprobs:
        specs = [dict(s, logprobs=3) for s in specs]
    reqs = _requests(specs)
    gen = torch.Generator().manual_seed(99)
    history = []
    for _ in range(steps):
        logits = torch.randn(len(reqs), vocab, generator=gen) * 2
        out = sampler(logits, reqs)
        history.append((out.token_ids, out.logprobs))
        for req, token in zip(reqs, out.token_ids):
            req.all_token_ids.append(token)
    return history


def test_batched_sampler_equals_the_reference_step_after_step():
    """Greedy and seeded rows, penalties counted on the device, logit bias, min_tokens,
    top-k/top-p/min-p: the same tokens and logprobs as the one-request-at-a-time reference."""
    cpu = torch.device("cpu")
    for specs in (MIXED, [s for s in MIXED if s.get("top_k") or s.get("temperature") == 0]):
        got = _run_steps(Sampler(cpu), specs, 30, logprobs=True)
        want = _run_steps(ReferenceSampler(cpu), specs, 30, logprobs=True)
        assert [g[0] for g in got] == [w[0] for w in want]
        for (_, lps_got), (_, lps_want) in zip(got, want):
            for a, b in zip(lps_got, lps_want):
                assert a.token_rank == b.token_rank and [t for t, _ in a.top] == [t for t, _ in b.top]
                assert abs(a.token_logprob - b.token_logprob) < 1e-6


def test_penalized_logits_are_exactly_the_references():
    cpu = torch.device("cpu")
    reqs = _requests(MIXED)
    for req in reqs:
        req.all_token_ids.extend([5, 5, 9, 1])  # some output already
    logits = torch.randn(len(reqs), 64, generator=torch.Generator().manual_seed(3))
    batched = Sampler(cpu)
    got = batched.penalties_and_masks(logits.clone(), reqs, batched._penalty_rows(logits, reqs))
    want = ReferenceSampler(cpu).penalties_and_masks(logits.clone(), reqs)
    assert torch.equal(got, want)


def test_top_k_path_races_only_the_candidates_yet_picks_the_full_races_token(monkeypatch):
    import llmserve.engine.sampler as sampler_module

    specs = [dict(temperature=0.9, seed=s, top_k=k, top_p=p) for s, k, p in ((1, 5, 1.0), (2, 40, 0.8), (3, 64, 0.95))]
    fast = _run_steps(Sampler(torch.device("cpu")), specs, 25)
    monkeypatch.setattr(sampler_module, "TOPK_FAST", 0)  # every row through the full sort
    full = _run_steps(Sampler(torch.device("cpu")), specs, 25)
    assert [f[0] for f in fast] == [f[0] for f in full]


def test_random_rows_are_grouped_by_the_path_that_samples_them():
    """With kernels: temperature-only batches take the race, rows without a top-k the filtered race,
    small top-k's the top-k race, the rest the sort; without kernels the filtered rows sort. Each
    group names its own seeded rows."""
    from llmserve.engine.sampler import _groups, _random_rows

    reqs = _requests([dict(temperature=0.8, seed=1), dict(temperature=0), dict(temperature=0.7, top_k=40, seed=2),
                      dict(temperature=1.0, top_p=0.9), dict(temperature=0.9, top_k=5000, seed=3), dict(temperature=1.0, min_p=0.1, seed=4)])  # fmt: skip
    random = _random_rows(reqs)
    got = {path: (g.rows, g.seeded) for path, g in _groups(random, use_kernels=True)}
    assert got == {"filtered": ([0, 3, 5], [0, 2]), "top_k": ([2], [0]), "sort": ([4], [0])}
    assert sorted(path for path, _ in _groups(random, use_kernels=False)) == ["sort", "top_k"]
    assert [path for path, _ in _groups(_random_rows(_requests([dict(temperature=0.5)] * 3)), use_kernels=True)] == [
        "race"
    ]
    plain = _random_rows(_requests([dict(temperature=0.5), dict(temperature=0.5, top_p=0.9)]))
    assert [(path, g is plain) for path, g in _groups(plain, use_kernels=True)] == [("filtered", True)]


def test_penalty_slots_are_reused_and_grow():
    from llmserve.engine.penalty_state import PenaltyState

    state = PenaltyState(64, torch.device("cpu"), capacity=2)
    reqs = _requests([dict(presence_penalty=0.5)] * 6)
    rows = state.rows_for(reqs[:3])
    assert sorted(rows.slots) == [0, 1, 2] and state.capacity == 3  # made on first use, for the batch
    state.count(torch.tensor([7, 7, 8]), rows)
    assert state.counts[rows.slots[0], 7] == 1 and state.counts[rows.slots[2], 8] == 1
    state.release(["r0"])
    again = state.rows_for(reqs[3:4])  # r3 takes r0's slot, and its row starts clean
    assert again.slots == [rows.slots[0]] and state.counts[rows.slots[0]].sum() == 0
    more = state.rows_for(reqs[1:3] + reqs[4:6])  # two more: the rows double, the counts stay
    assert state.capacity == 6 and more.slots[:2] == rows.slots[1:] and state.counts[rows.slots[2], 8] == 1


def test_fast_paths_of_uniform_batches_equal_the_reference():
    """Batches where every row samples alike take shorter paths (sampler.py: plain greedy rows
    argmax the 16-bit logits without a float copy; when every row samples at random, no gather
    of the rows and, at temperature 1, no division): the same tokens as the reference, step
    after step, ties in bfloat16 included."""
    cpu = torch.device("cpu")
    for specs in (
        [dict(temperature=0)] * 5,
        [dict(temperature=1.0, seed=20 + i) for i in range(5)],
        [dict(temperature=0.8, seed=30 + i, top_p=0.9) for i in range(5)],
        [dict(temperature=1.0, seed=40 + i, min_p=0.1) for i in range(4)] + [dict(temperature=0)],
    ):
        got = _run_steps(Sampler(cpu), specs, 20)
        want = _run_steps(ReferenceSampler(cpu), specs, 20)
        assert [g[0] for g in got] == [w[0] for w in want], specs
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 3.0, 3.0, 3.0]], dtype=torch.bfloat16)
    greedy = [Request(EngineCoreRequest(f"g{i}", [1, 2], SamplingParams(temperature=0), 8, (2,))) for i in range(2)]
    assert Sampler(cpu)(logits, greedy).token_ids == ReferenceSampler(cpu)(logits, greedy).token_ids == [1, 0]


def test_the_batch_plan_follows_requests_joining_leaving_and_moving():
    """The sampler keeps a batch's plan while the batch holds the same requests in the same order:
    batches that gain, lose and reorder requests (a finished one forgotten) still give the
    reference's tokens, seeded rows' noise following their output counts and min_tokens masks
    lifting on time; a steady batch is planned once."""
    import llmserve.engine.sampler as sampler_module

    cpu = torch.device("cpu")
    orders = [[0, 1, 2, 3], [0, 1, 2, 3], [3, 2, 1, 0], [3, 2, 1, 0, 4, 5], [4, 5, 6, 7, 0], [4, 5, 6, 7, 0],
              [7, 6, 5, 4], [1, 7, 6, 5, 4, 2], [1, 7, 6, 5, 4, 2], [2, 1]]  # fmt: skip
    finished = {4: [3]}  # after step 4, request 3 is gone for good

    def run(sampler) -> list[list[int]]:
        reqs = _requests(MIXED)
        gen = torch.Generator().manual_seed(5)
        out = []
        for step, order in enumerate(orders):
            batch = [reqs[i] for i in order]
            tokens = sampler(torch.randn(len(batch), 64, generator=gen) * 2, batch).token_ids
            out.append(tokens)
            for req, token in zip(batch, tokens):
                req.all_token_ids.append(token)
            sampler.forget([f"r{i}" for i in finished.get(step, [])])
        return out

    planned = []
    real = sampler_module._random_rows
    try:
        sampler_module._random_rows = lambda *a, **k: planned.append(1) or real(*a, **k)
        got = run(Sampler(cpu))
    finally:
        sampler_module._random_rows = real
    assert got == run(ReferenceSampler(cpu))
    assert len(planned) == 8  # 10 steps; steps 1 and 8 keep the batch before them (step 5's was forgotten from)


def test_a_greedy_batch_keeps_its_min_tokens_mask_until_the_count_is_reached():
    """A batch of plain greedy rows, one with min_tokens 3, logits that favour EOS: the plan
    (made once) still masks EOS for that row's first three tokens, and only then lets it win."""
    reqs = _requests([dict(temperature=0, min_tokens=3), dict(temperature=0)])
    sampler, logits = Sampler(torch.device("cpu")), torch.zeros(2, 8)
    logits[:, 2], logits[:, 5] = 9.0, 4.0  # EOS (2) first, then 5
    got = []
    for _ in range(5):
        tokens = sampler(logits.clone(), reqs).token_ids
        got.append(tokens)
        for req, token in zip(reqs, tokens):
            req.all_token_ids.append(token)
    assert got == [[5, 2], [5, 2], [5, 2], [2, 2], [2, 2]]


def test_the_warm_up_batches_meet_every_variant_of_the_sampling_kernels():
    """The kernels compile one variant per (row list, temperatures, seeds) of a launch: the warm-up
    batches give the filtered race all eight and the race all four, so no first use compiles
    inside a run (a fresh H200's seeded top-p row did: −8.4 % against −1.4 % warm)."""
    from llmserve.engine.model_runner import warm_sampling_batches
    from llmserve.engine.sampler import _groups, _random_rows

    seen: dict[str, set] = {"filtered": set(), "race": set()}
    for batch in warm_sampling_batches():
        reqs = [Request(EngineCoreRequest(f"w{j}", [1], p, 8, (2,))) for j, p in enumerate(batch)]
        random = _random_rows(reqs)
        for path, group in _groups(random, use_kernels=True) if random.rows else []:
            if path in seen:
                flags = (len(group.rows) < len(reqs), any(t != 1.0 for t in group.temperature))
                seen[path].add(flags + ((bool(group.seeded),) if path == "filtered" else ()))
    assert len(seen["filtered"]) == 8 and len(seen["race"]) == 4
