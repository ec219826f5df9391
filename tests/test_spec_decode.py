"""Speculative decoding with n-gram proposals (engine/spec_decode.py, engine/spec_ngram.py):
lossless against the same engine without it (and transformers), with every engine feature on."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from conftest import hf_greedy

from llmserve import LLM, SamplingParams
from llmserve.config import ConfigError, speculative_config
from llmserve.engine.spec_decode import kept_tokens, rejection_sample, verify_greedy
from llmserve.engine.spec_ngram import TokenArrays, propose, propose_reference

pytestmark = pytest.mark.unit

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _prompts(seed: int) -> list[list[int]]:
    """Prompts that repeat themselves (n-grams find proposals) and one that does not."""
    rng = random.Random(seed)
    motif = [rng.randrange(3, 500) for _ in range(9)]
    return [
        [1] + motif * 4,
        [1] + [rng.randrange(3, 500) for _ in range(37)],
        [1] + motif[:5] * 7 + [rng.randrange(3, 500) for _ in range(3)],
    ]


# -- the proposer ----------------------------------------------------------------------------
def test_batched_proposals_equal_the_reference_loop():
    rng = random.Random(3)
    for _ in range(60):
        seqs = []
        for _ in range(rng.randrange(1, 7)):
            alphabet = rng.randrange(2, 6)  # few distinct tokens: many repeats
            seqs.append([rng.randrange(alphabet) for _ in range(rng.randrange(1, 40))])
        least = rng.randrange(1, 4)
        most = rng.randrange(least, 6)
        ks = [rng.randrange(0, 6) for _ in seqs]
        got = propose([np.array(s, dtype=np.int64) for s in seqs], ks, least, most)
        want = [propose_reference(s, k, least, most) if k else [] for s, k in zip(seqs, ks)]
        assert got == want, (seqs, ks, least, most)


def test_reference_proposal_takes_the_longest_latest_match():
    tokens = [5, 6, 7, 1, 5, 6, 8, 2, 6, 7, 9, 5, 6]
    assert propose_reference(tokens, 2, 1, 3) == [8, 2]  # "5 6" last occurred at 4: what followed
    assert propose_reference(tokens + [7], 3, 1, 3) == [1, 5, 6]  # "5 6 7" at 0 beats "6 7" at 8
    assert propose_reference([1, 2, 3], 4, 1, 3) == []


def test_token_arrays_grow_with_the_request():
    arrays = TokenArrays()
    tokens = list(range(10))
    assert arrays.of("a", tokens).tolist() == tokens
    tokens += list(range(200))
    assert arrays.of("a", tokens).tolist() == tokens
    assert arrays.of("a", tokens[:5]).tolist() == tokens[:5]  # shorter (a recompute): made again
    arrays.forget("a")


def test_verify_greedy_keeps_the_agreeing_prefix_and_one_more():
    assert verify_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all accepted, a bonus token
    assert verify_greedy([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert verify_greedy([4, 5, 6], [8, 5, 6, 7]) == [8]


# -- configuration ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, message",
    [
        ({"method": "medusa", "model": "x"}, "not supported yet"),
        ({"method": "draft_model"}, 'needs "model"'),
        ({"method": "magic"}, "unknown method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "ngram", "lookahead": 3}, "unknown key"),
        ("{not json", "not JSON"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_speculative_configs_are_refused(value, message):
    with pytest.raises(ConfigError, match=message):
        speculative_config(value)


def test_speculative_config_from_the_command_line_and_defaults():
    cfg = speculative_config(json.dumps({"method": "ngram", "num_speculative_tokens": 3}))
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (3, 2, 5)
    assert speculative_config(None) is None


# -- the engine: lossless ----------------------------------------------------------------------
VARIANTS = {
    "plain": dict(),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "chunked-small-budget": dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
    "preempt": dict(
        block_size=8, num_gpu_blocks_override=14, max_model_len=112, swap_space=0, admission_reserve_tokens=0
    ),
    "preempt-swap": dict(
        block_size=8, num_gpu_blocks_override=14, max_model_len=112, swap_space=0.001, admission_reserve_tokens=0
    ),
    "host-tier": dict(
        block_size=8, num_gpu_blocks_override=14, max_model_len=112, kv_offload_cpu_gb=0.001, admission_reserve_tokens=0
    ),
}
# gemma3's preempt variant: six KV groups of one layer (a block id is a sixth of llama's), in
# chunks of 16 tokens (its windowed groups hold a window and a chunk)
GEMMA_PREEMPT = dict(num_gpu_blocks_override=45, enable_chunked_prefill=True, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def plain_outputs(model_dirs):
    """Each family's greedy tokens from the engine without speculation (max_tokens 30)."""
    cache = {}

    def get(family):
        if family not in cache:
            llm = LLM(model_dirs[family], max_model_len=160)
            cache[family] = _generate(llm, _prompts(7))
        return cache[family]

    return get


def _generate(llm: LLM, prompts, params: SamplingParams | None = None) -> list[list[int]]:
    params = params or SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_greedy_tokens_equal_the_engine_without_speculation(model_dirs, plain_outputs, family, variant):
    options = {"max_model_len": 160, **VARIANTS[variant]}
    if family == "gemma3" and (variant.startswith("preempt") or variant == "host-tier"):
        options.update(GEMMA_PREEMPT)
    llm = LLM(model_dirs[family], speculative_config=NGRAM, **options)
    assert _generate(llm, _prompts(7)) == plain_outputs(family)
    stats = llm.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens > 0
    assert sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens
    if variant.startswith("preempt"):
        assert stats.num_preemptions > 0, "the KV budget was meant to force preemption"
    if variant == "preempt-swap":
        assert stats.num_swap_outs > 0, "preemption was meant to swap"


def test_speculation_matches_transformers(model_dirs):
    prompts = _prompts(11)[:2]
    llm = LLM(model_dirs["llama"], max_model_len=160, speculative_config=NGRAM)
    assert _generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=24)) == hf_greedy(
        model_dirs["llama"], prompts, 24
    )


def test_other_requests_decode_beside_speculating_ones(model_dirs):
    """Sampled (seeded), penalised and logprob requests in the batch of speculating greedy
    ones: each request's tokens are those of the engine without speculation."""
    prompts = _prompts(5)
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=20, ignore_eos=True, logprobs=2),
    ]
    requests = [{"prompt_token_ids": p} for p in prompts]
    plain = LLM(model_dirs["llama"], max_model_len=160).generate(requests, params, use_tqdm=False)
    spec = LLM(model_dirs["llama"], max_model_len=160, speculative_config=NGRAM)
    got = spec.generate(requests, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert spec.stats().spec_num_drafts > 0


def test_stops_and_lengths_inside_accepted_proposals(model_dirs, plain_outputs):
    """A stop token, or max_tokens, that falls inside a step's accepted tokens ends the output
    exactly where decoding one token a step ends it."""
    want = plain_outputs("llama")
    prompts = _prompts(7)
    stop = want[0][9]  # a token the first request makes (speculated: its prompt repeats)
    llm = LLM(model_dirs["llama"], max_model_len=160, speculative_config=NGRAM)
    got = _generate(llm, prompts[:1], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop]))
    assert got[0] == want[0][: want[0].index(stop) + 1]
    for max_tokens in (1, 2, 7, 13):
        got = _generate(llm, prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        assert got == [w[:max_tokens] for w in want]


def test_no_speculation_past_the_batch_limit(model_dirs, plain_outputs):
    """Past `disable_by_batch_size` decoding sequences nobody speculates, and steps overlap
    (async scheduling) as without speculation; at or below it they speculate, one step at a time."""
    spec = dict(NGRAM, disable_by_batch_size=2)
    llm = LLM(model_dirs["llama"], max_model_len=160, speculative_config=spec)
    answers = []
    original = llm.core.can_overlap

    def watch():
        answers.append(original())
        return answers[-1]

    llm.core.can_overlap = watch
    assert _generate(llm, _prompts(7)) == plain_outputs("llama")
    many = llm.stats().spec_num_drafts
    assert many == 0 and any(answers)  # three decoding at once: none speculates, steps overlap
    answers.clear()
    _generate(llm, _prompts(7)[:2])
    assert llm.stats().spec_num_drafts > many and not any(answers)  # two at once speculate, in order


@pytest.mark.integration
def test_serve_speculates_and_reports_vllm_s_counters(tmp_path, model_dirs):
    """`llmserve serve --speculative-config` through the official openai client: the greedy
    completion is the engine's without speculation; /metrics counts proposals and acceptances."""
    import httpx
    import openai
    from server_utils import start_server

    prompt = _prompts(7)[0]
    want = LLM(model_dirs["llama"], max_model_len=160).generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].text  # fmt: skip
    server = start_server([model_dirs["llama"], "--max-model-len", "160", "--served-model-name", "tiny",
                           "--speculative-config", json.dumps(NGRAM)], str(tmp_path / "serve.log"))  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0.0,
                                        extra_body={"ignore_eos": True})  # fmt: skip
        assert out.choices[0].text == want
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        counts = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("vllm:spec_decode_num_") and "_total" in line and "per_pos" not in line}  # fmt: skip
        assert counts["vllm:spec_decode_num_draft_tokens_total"] > 0
        assert (
            0
            < counts["vllm:spec_decode_num_accepted_tokens_total"]
            <= counts["vllm:spec_decode_num_draft_tokens_total"]
        )
        assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in metrics
    finally:
        server.stop()


# -- rejection sampling ------------------------------------------------------------------------
def _draws(probs: torch.Tensor, drafts: list[int], n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    logits = probs.log()
    out = []
    d = torch.tensor(drafts)
    for _ in range(n):
        noise = torch.empty(probs.shape).exponential_(generator=g)
        uniform = torch.rand(len(drafts), generator=g)
        accepted, replacements, bonus = rejection_sample(logits, d, uniform, noise)
        out.append(kept_tokens(drafts, accepted.tolist(), replacements.tolist(), int(bonus[0])))
    return out


def test_rejection_sampling_keeps_the_target_distribution():
    """Chi-square over 6,000 draws on a 6-token vocabulary: the first token is distributed as the
    target's first position, and after an accepted proposal the second as its second."""
    from scipy.stats import chisquare

    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(3, 6, generator=g) * 1.5, dim=-1)
    drafts = [int(probs[0].argmax()), 2]
    draws = _draws(probs, drafts, 6000, seed=1)
    first = np.bincount([d[0] for d in draws], minlength=6)
    assert chisquare(first, probs[0].numpy() * len(draws)).pvalue > 1e-3
    after = [d[1] for d in draws if d[0] == drafts[0] and len(d) > 1]
    second = np.bincount(after, minlength=6)
    assert len(after) > 1000 and chisquare(second, probs[1].numpy() * len(after)).pvalue > 1e-3
    # and not by luck: the proposal's own distribution (all on it) is far from the target's
    assert chisquare(first + 1, np.eye(6)[drafts[0]] * len(draws) + 1).pvalue < 1e-6


def test_sampled_requests_speculate_and_seeded_ones_reproduce(model_dirs):
    prompts = _prompts(7)
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=30, ignore_eos=True)
    llm = LLM(model_dirs["llama"], max_model_len=160, speculative_config=NGRAM)
    first = _generate(llm, prompts, params)
    assert llm.stats().spec_num_drafts > 0
    assert _generate(llm, prompts, params) == first  # the same seed: the same tokens
    assert all(len(t) == 30 for t in first)


def test_a_request_proposes_what_it_lately_had_accepted():
    from llmserve.config import speculative_config
    from llmserve.engine.spec_decode import SpecDecoder

    spec = SpecDecoder(speculative_config({"method": "ngram", "num_speculative_tokens": 5}), 1000)
    assert spec.budget("a") == 5  # a new request: K
    for _ in range(4):
        spec.record("a", spec.budget("a"), 0)
    assert spec.budget("a") == 1  # its proposals keep failing: one a step
    for _ in range(10):
        spec.record("a", spec.budget("a"), spec.budget("a"))
    assert spec.budget("a") == 5  # accepted again: back up to K, a token more each time
    assert spec.counts.num_drafts == 14
    spec.forget("a")
    assert spec.budget("a") == 5


def test_logprobs_of_speculated_tokens_are_the_model_s(model_dirs):
    """A request asking logprobs speculates, and each token's logprob, rank and top 3 equal
    those of decoding one token a step."""
    prompts = _prompts(7)[:1]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3)
    requests = [{"prompt_token_ids": p} for p in prompts]
    plain = LLM(model_dirs["llama"], max_model_len=160).generate(requests, params, use_tqdm=False)[0].outputs[0]
    llm = LLM(model_dirs["llama"], max_model_len=160, speculative_config=NGRAM)
    spec = llm.generate(requests, params, use_tqdm=False)[0].outputs[0]
    assert llm.stats().spec_num_accepted_tokens > 0
    assert spec.token_ids == plain.token_ids and len(spec.logprobs) == len(plain.logprobs) == 20
    for got, want in zip(spec.logprobs, plain.logprobs):
        assert list(got) == list(want)  # the same top tokens (and the chosen one), in order
        for token in want:
            assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-4)
            assert got[token].rank == want[token].rank
