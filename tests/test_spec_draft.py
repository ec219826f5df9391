"""Speculative decoding with a draft model (engine/spec_draft.py, spec_draft_blocks.py,
spec_draft_check.py): lossless against the engine without it, whatever the draft; the target's
distribution kept for sampled requests with the draft's own q; both KV caches left empty."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.config import ConfigError, EngineArgs
from llmserve.engine.request import EngineCoreRequest
from llmserve.engine.spec_decode import kept_tokens, rejection_sample
from llmserve.engine.spec_draft_blocks import DraftBlocks
from llmserve.model.random_model import build_tokenizer, make_random_model

pytestmark = pytest.mark.unit


def _draft(model: str, k: int = 4, **more) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, **more}


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 500) for _ in range(n)] for n in (21, 38, 6)]


def _generate(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


def _draft_pool_empty(llm: LLM) -> bool:
    blocks = llm.core.draft.blocks
    return blocks.num_free == blocks.num_blocks and not blocks.seqs


# -- rejection sampling with the draft's q ----------------------------------------------------
def _draws(p: torch.Tensor, q: torch.Tensor, n: int, seed: int) -> tuple[list[list[int]], float]:
    """`n` verifications of two proposals drawn from q's rows, against the target p [3, V]; and
    the share of first proposals accepted."""
    g = torch.Generator().manual_seed(seed)
    out, accepted_first = [], 0
    for _ in range(n):
        drafts = torch.multinomial(q, 1, generator=g)[:, 0]
        noise = torch.empty(p.shape).exponential_(generator=g)
        uniform = torch.rand(2, generator=g)
        accepted, replacements, bonus = rejection_sample(p.log(), drafts, uniform, noise, q)
        out.append(kept_tokens(drafts.tolist(), accepted.tolist(), replacements.tolist(), int(bonus[0])))
        accepted_first += bool(accepted[0])
    return out, accepted_first / n


def _expected(probs, total: int) -> np.ndarray:
    """Expected counts of `total` draws (float64, summing to `total` as chisquare requires)."""
    e = np.asarray(probs, dtype=np.float64)
    return e / e.sum() * total


def test_rejection_sampling_with_draft_probabilities_keeps_the_target_distribution():
    """Chi-square over 3,000 verifications on 6 tokens, proposals drawn from a q near p: the first
    token is distributed as p's first row, and after an accepted proposal the next as its second.
    A proposal is accepted with probability sum(min(p, q)), the most any scheme keeping p can
    reach (treating it as n-gram's, all on the token, would accept sum(p q))."""
    from scipy.stats import chisquare

    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 6, generator=g) * 1.5, dim=-1)
    q = torch.softmax(p[:2].log() + torch.randn(2, 6, generator=g), dim=-1)  # near p, not p
    n = 3000
    draws, acceptance = _draws(p, q, n, seed=1)
    first = np.bincount([d[0] for d in draws], minlength=6)
    assert chisquare(first, _expected(p[0], n)).pvalue > 1e-3
    # a second token exists only when the first proposal was accepted
    second = np.bincount([d[1] for d in draws if len(d) > 1], minlength=6)
    assert second.sum() > 1000 and chisquare(second, _expected(p[1], second.sum())).pvalue > 1e-3
    best, blind = float(torch.minimum(p[0], q[0]).sum()), float((p[0] * q[0]).sum())
    assert abs(acceptance - best) < 4 * (best * (1 - best) / n) ** 0.5 and best > blind + 0.1


def test_a_draft_equal_to_the_target_is_always_accepted():
    g = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(4, 9, generator=g), dim=-1)
    for seed in range(50):
        drafts = torch.multinomial(p[:3], 1, generator=torch.Generator().manual_seed(seed))[:, 0]
        accepted, _, _ = rejection_sample(p.log(), drafts, torch.rand(3), torch.empty(p.shape).exponential_(), p[:3])
        assert accepted.all()


# -- the draft's block bookkeeping ------------------------------------------------------------
def test_draft_blocks_keep_accepted_proposals_and_roll_back_the_rest():
    blocks = DraftBlocks(num_blocks=6, block_size=4)
    tokens = list(range(10))
    assert blocks.sync("a", tokens) == 0  # a new request feeds everything
    assert blocks.reserve("a", len(tokens) + 3 - 1, {"a"})  # positions for 9 real tokens and 2 guesses
    assert len(blocks.seqs["a"].block_ids) == 3
    blocks.fed("a", 10, [50, 51])  # proposed 50, 51, 52; the draft fed 50 and 51
    assert blocks.sync("a", tokens + [50, 77]) == 11  # 50 accepted, 51 rejected (the target made 77)
    blocks.fed("a", 12, [60, 61])
    assert blocks.sync("a", tokens + [50, 77, 60, 61, 62, 9]) == 14  # every guess kept: 62 and 9 to feed
    blocks.fed("a", 16, [])
    assert blocks.sync("a", tokens + [50, 77, 60, 61, 62, 9]) == 15  # nothing new: the last token is fed again


def test_draft_blocks_evict_the_least_recent_requests_outside_the_step():
    blocks = DraftBlocks(num_blocks=4, block_size=4)
    for rid in ("a", "b"):
        blocks.sync(rid, [1] * 7)
        assert blocks.reserve(rid, 8, {rid})
    assert blocks.num_free == 0
    blocks.sync("c", [1] * 3)
    assert not blocks.reserve("c", 8, {"a", "b", "c"})  # the others are in this step: no room
    assert blocks.reserve("c", 8, {"b", "c"})  # "a" is not: its blocks go, it starts over later
    assert "a" not in blocks.seqs and blocks.sync("a", [1] * 7) == 0
    for rid in ("a", "b", "c"):
        blocks.forget(rid)
    assert blocks.num_free == 4


# -- the engine: lossless -------------------------------------------------------------------
VARIANTS = {
    "plain": dict(),
    "chunked-no-prefix-cache": dict(
        enable_chunked_prefill=True, max_num_batched_tokens=16, enable_prefix_caching=False
    ),
    "preempt": dict(
        block_size=8, num_gpu_blocks_override=14, max_model_len=112, swap_space=0, admission_reserve_tokens=0
    ),
    "preempt-swap": dict(
        block_size=8, num_gpu_blocks_override=14, max_model_len=112, swap_space=0.001, admission_reserve_tokens=0
    ),
}


@pytest.fixture(scope="module")
def plain_greedy(model_dirs):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = _generate(LLM(model_dirs[family], max_model_len=160), _prompts(7), GREEDY)
        return cache[family]

    return get


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_equal_the_engine_without_speculation(model_dirs, plain_greedy, variant):
    """A draft of another family (random: it rarely agrees) and of the target's own weights
    (always agrees): the same tokens as without speculation, the caches consistent through
    chunked prefill, prefix caching and preemption by recompute and by swap."""
    options = {"max_model_len": 160, **VARIANTS[variant]}
    for draft in ("qwen2", "llama"):
        llm = LLM(model_dirs["llama"], speculative_config=_draft(model_dirs[draft]), **options)
        assert _generate(llm, _prompts(7), GREEDY) == plain_greedy("llama"), draft
        stats = llm.stats()
        assert stats.spec_num_draft_tokens > 0
        if draft == "llama":  # the target as its own draft: every proposal accepted
            assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
        else:
            assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens / 2
        if variant.startswith("preempt"):
            assert stats.num_preemptions > 0, "the KV budget was meant to force preemption"
        assert _draft_pool_empty(llm)


def test_a_target_with_sliding_windows_and_a_draft_of_another_family(model_dirs, plain_greedy):
    llm = LLM(model_dirs["gemma3"], max_model_len=160, speculative_config=_draft(model_dirs["qwen3"], k=3))
    assert _generate(llm, _prompts(7), GREEDY) == plain_greedy("gemma3")
    assert llm.stats().spec_num_drafts > 0 and _draft_pool_empty(llm)


def test_batch_of_speculating_and_other_requests(model_dirs):
    """Greedy, logprob and sampled requests speculate beside a penalised one that does not: the
    greedy, logprob and penalised requests make the tokens of the engine without speculation."""
    prompts = _prompts(5) + _prompts(6)[:1]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=4, max_tokens=20, ignore_eos=True),
    ]
    requests = [{"prompt_token_ids": p} for p in prompts]
    plain = LLM(model_dirs["llama"], max_model_len=160).generate(requests, params, use_tqdm=False)
    llm = LLM(model_dirs["llama"], max_model_len=160, speculative_config=_draft(model_dirs["llama"]))
    got = llm.generate(requests, params, use_tqdm=False)
    for i in range(3):
        assert got[i].outputs[0].token_ids == plain[i].outputs[0].token_ids, i
    for g, w in zip(got[1].outputs[0].logprobs, plain[1].outputs[0].logprobs):
        assert list(g) == list(w)
    assert len(got[3].outputs[0].token_ids) == 20
    stats = llm.stats()
    assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens


def test_seeded_sampled_requests_reproduce(model_dirs):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True)
    llm = LLM(model_dirs["llama"], max_model_len=160, speculative_config=_draft(model_dirs["qwen3"]))
    first = _generate(llm, _prompts(7), params)
    assert llm.stats().spec_num_drafts > 0
    assert _generate(llm, _prompts(7), params) == first
    assert all(len(t) == 24 for t in first)


# -- the engine: the target's distribution ------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    """A target and a draft (another random model) over 16 tokens."""
    root = tmp_path_factory.mktemp("tiny-vocab")
    return (str(make_random_model(root / "target", "llama", seed=0, vocab_size=16)),
            str(make_random_model(root / "draft", "llama", seed=3, vocab_size=16, num_hidden_layers=1)))  # fmt: skip


def _exact_marginals(model_dir: str, prompt: list[int], temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """P(second output token) and P(third) of sampling at `temperature`, summed over the paths
    before them (transformers, float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    v = model.config.vocab_size

    def next_probs(seqs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.softmax(model(seqs).logits[:, -1].double() / temperature, dim=-1)

    base = torch.tensor([prompt])
    p0 = next_probs(base)[0]  # [V]
    ones = base.repeat(v, 1)
    p1 = next_probs(torch.cat([ones, torch.arange(v)[:, None]], 1))  # [t0, t1]
    pairs = torch.cartesian_prod(torch.arange(v), torch.arange(v))  # (t0, t1) rows
    p2 = next_probs(torch.cat([base.repeat(v * v, 1), pairs], 1)).view(v, v, v)  # [t0, t1, t2]
    joint01 = p0[:, None] * p1
    return joint01.sum(0).numpy(), (joint01[:, :, None] * p2).sum((0, 1)).numpy()


def test_sampled_requests_keep_the_target_distribution(tiny_vocab):
    """1,200 unseeded requests of 3 tokens at temperature 0.1 over 16 tokens, proposals drawn from a
    different model's q: the second and third tokens' counts against their exact probabilities
    (chi-square), with a fair share of the proposals rejected (q mattered)."""
    from scipy.stats import chisquare

    target, draft = tiny_vocab
    prompt, temperature, n = [1, 5, 9, 3, 7, 11], 0.1, 1200
    want1, want2 = _exact_marginals(target, prompt, temperature)
    llm = LLM(target, max_model_len=64, max_num_seqs=256,
              speculative_config=_draft(draft, k=3, disable_by_batch_size=1 << 20))  # fmt: skip
    params = SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True)
    outs = _generate(llm, [prompt] * n, params)
    stats = llm.stats()
    assert 0.1 < stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens < 0.9
    for position, want in ((1, want1), (2, want2)):
        counts = np.bincount([o[position] for o in outs], minlength=16)
        keep = want * n >= 5  # (chi-square wants expected counts of 5 or more: the rest pooled)
        observed, expected = counts[keep], want[keep]
        if not keep.all():
            observed, expected = np.append(observed, counts[~keep].sum()), np.append(expected, want[~keep].sum())
        expected = _expected(expected, observed.sum())
        assert chisquare(observed, expected).pvalue > 1e-3, position


# -- abort and refusals --------------------------------------------------------------------------
def test_abort_mid_speculation_frees_both_caches(model_dirs):
    llm = LLM(model_dirs["llama"], max_model_len=160, speculative_config=_draft(model_dirs["llama"]))
    core = llm.core
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    for i, prompt in enumerate(_prompts(3)):
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params, 100, (2,)))
    while core.stats().spec_num_drafts < 4:
        core.step()
    assert core.draft.blocks.num_free < core.draft.blocks.num_blocks  # the draft holds blocks now
    core.abort_requests(["r0", "r1", "r2"])
    while core.has_unfinished():
        core.step()
    core.step()  # (the finished ids reach the runner)
    assert core.kv.pool.num_used == 0
    assert _draft_pool_empty(llm)


def test_bad_drafts_are_refused(model_dirs, tmp_path):
    target = model_dirs["llama"]

    def start(draft: dict) -> None:
        EngineArgs(model=target, max_model_len=160, speculative_config=draft).create_engine_config()

    small_vocab = make_random_model(tmp_path / "v256", "llama", vocab_size=256)
    with pytest.raises(ConfigError, match="vocabulary"):
        start(_draft(str(small_vocab)))
    other_tokenizer = make_random_model(tmp_path / "tok", "llama", vocab_size=512)
    build_tokenizer(other_tokenizer, vocab_size=300)  # the same vocabulary size, other tokens
    with pytest.raises(ConfigError, match="tokenizer"):
        start(_draft(str(other_tokenizer)))
    with pytest.raises(ConfigError, match="sliding-window"):
        start(_draft(model_dirs["gemma3"]))
    with pytest.raises(ConfigError, match="does not exist"):
        start(_draft(str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="needs"):
        start({"method": "draft_model"})
    with pytest.raises(ConfigError, match="unknown key"):
        start(_draft(target, prompt_lookup_max=3))
    with pytest.raises(ConfigError, match="sleep mode"):
        EngineArgs(model=target, speculative_config=_draft(target), enable_sleep_mode=True).create_engine_config()
    cfg = EngineArgs(model=target, max_model_len=160, speculative_config={"model": target}).create_engine_config()
    assert cfg.speculative.method == "draft_model" and cfg.speculative.draft_arch.vocab_size == 512  # (vLLM's guess)


def test_a_gguf_draft(model_dirs, plain_greedy, tmp_path):
    """The target's own weights as a GGUF file (its tokenizer in the file) draft for it."""
    from llmserve.model.gguf.writer import write_gguf

    gguf = write_gguf(model_dirs["llama"], tmp_path / "draft.gguf")
    llm = LLM(model_dirs["llama"], max_model_len=160, speculative_config=_draft(str(gguf)))
    assert _generate(llm, _prompts(7), GREEDY) == plain_greedy("llama")
    stats = llm.stats()
    assert 0 < stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
