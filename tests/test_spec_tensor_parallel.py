"""Speculative decoding under tensor and pipeline parallelism (CPU, gloo, real processes): n-gram, a
draft model, EAGLE and EAGLE-3 heads at TP=2 give the greedy tokens of TP=1 without speculation and
TP=1's proposals and acceptance counts with it (the proposers run on rank 0 alone: the draft and the
heads whole, the heads over whole tables of the target's vocabulary gathered at start; the
verification's forward runs on every rank); EAGLE heads at PP=2 the same (their states travel
between stages); seeded sampled requests run and reproduce; a killed worker fails the next request
at once."""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from test_spec_eagle import target_with_heads

from llmserve import LLM, SamplingParams
from llmserve.engine.tp_workers import WorkerDiedError
from llmserve.model import whole_vocab
from llmserve.model.whole_vocab import WholeVocab

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True)
# repeats for the n-gram proposer to find; one prompt longer than a 16-token chunk
PROMPTS = [[1, 5, 9, 30, 44, 7, 8, 100, 101, 5, 9, 30], [1, 2, 3], [1] + list(range(200, 236)),
           [1, 7, 7, 7, 7, 7, 7, 7]]  # fmt: skip
OPTIONS = dict(max_model_len=128, enable_chunked_prefill=True, max_num_batched_tokens=16)


def _truncate(src: str, out: Path, layers: int) -> str:
    """scripts/truncate_model.py: the target's first layers, a draft that agrees with it often."""
    spec = importlib.util.spec_from_file_location(
        "truncate_model", Path(__file__).parents[1] / "scripts/truncate_model.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.truncate(Path(src), out, layers)
    return str(out)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A 4-layer Llama target, each method's configuration, and TP=1's greedy tokens without speculation."""
    root = tmp_path_factory.mktemp("spec_tp")
    target, heads = target_with_heads(root)
    configs = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
        "draft_model": {"method": "draft_model", "model": _truncate(target, root / "draft", 2),
                        "num_speculative_tokens": 3},
        **{m: {"method": m, "model": heads[m], "num_speculative_tokens": 3} for m in heads},
    }  # fmt: skip
    with LLM(target, **OPTIONS) as llm:
        plain = _generate(llm, GREEDY)
    return target, configs, plain


def _generate(llm: LLM, params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _record(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(a request's tokens, its proposal) of every proposal the engine's draft or head makes from now on."""
    seen = []
    if llm.core.draft is None:
        return seen
    propose = llm.core.draft.propose

    def recording(requests, ks):
        proposals, probs = propose(requests, ks)
        seen.extend((list(r.all_token_ids), p) for r, p in zip(requests, proposals))
        return proposals, probs

    llm.core.draft.propose = recording
    return seen


def _counts(llm: LLM) -> tuple:
    s = llm.stats()
    return s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens, s.spec_accepted_per_position


@pytest.fixture(scope="module")
def single_rank(setup):
    """One rank's run of a method, made once: (its proposals, its acceptance counts)."""
    target, configs, plain = setup
    runs = {}

    def run(method: str) -> tuple[list, tuple]:
        if method not in runs:
            with LLM(target, speculative_config=configs[method], **OPTIONS) as llm:
                proposed = _record(llm)
                assert _generate(llm, GREEDY) == plain
                runs[method] = proposed, _counts(llm)
        return runs[method]

    return run


def _sampled_and_clean(llm: LLM, single: tuple, speculates: bool) -> None:
    """Seeded sampled requests speculate and reproduce; no KV block or draft block is left."""
    first = _generate(llm, SAMPLED)
    if speculates:
        assert _counts(llm)[0] > single[0], "the sampled requests were meant to speculate"
    assert _generate(llm, SAMPLED) == first
    assert all(len(t) == SAMPLED.max_tokens for t in first)
    assert llm.stats().num_blocks_used == 0
    if llm.core.draft is not None:
        blocks = llm.core.draft.blocks
        assert blocks.num_free == blocks.num_blocks and not blocks.seqs


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3"])
def test_tp2_speculation_equals_tp1(setup, single_rank, method):
    """Greedy tokens of TP=1 without speculation, TP=1's proposals and acceptance counts with it; seeded
    sampled requests reproduce at TP=2; no block or head cache left behind. (EAGLE-3: then a
    killed worker fails the next request within seconds.)"""
    target, configs, plain = setup
    spec = configs[method]
    proposed, single = single_rank(method)
    assert single[1] > 0 and (single[2] > 0 or method.startswith("eagle"))  # (random heads rarely agree)
    llm = LLM(target, speculative_config=spec, tensor_parallel_size=2, **OPTIONS)
    try:
        proposed_tp2 = _record(llm)
        assert _generate(llm, GREEDY) == plain
        assert _counts(llm) == single
        assert proposed_tp2 == proposed  # every proposal, in order (n-gram's follow from the tokens)
        _sampled_and_clean(llm, single, speculates=method != "ngram")  # (a random model's text repeats no n-gram)
        if method == "eagle3":
            (pid,) = llm.core.tp_driver.worker_pids
            os.kill(pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises((WorkerDiedError, RuntimeError)):
                _generate(llm, GREEDY)
            assert time.monotonic() - start < 30
    finally:
        start = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - start < 20


@pytest.mark.parametrize(("method", "in_flight"), [("eagle", 1), ("eagle3", 2)])
def test_pp2_eagle_heads_equal_tp1(setup, single_rank, method, in_flight):
    """Pipeline parallelism, 2 stages of 2 layers: the head runs on the last stage (the driver), the
    embedding it reads comes from the first stage at start, and EAGLE-3's states of layers 0 and 1
    travel with the carried tensors. Greedy tokens of one rank without speculation; with one batch in
    flight (the single rank's schedule) its proposals and counts exactly; with two (other batches:
    a request may propose a step earlier or later, or fewer tokens), a proposal after the same
    tokens is the same, one a prefix of the other. Seeded sampled requests reproduce."""
    target, configs, plain = setup
    proposed, single = single_rank(method)
    with LLM(target, speculative_config=configs[method], pipeline_parallel_size=2,
             pipeline_batches_in_flight=in_flight, **OPTIONS) as llm:  # fmt: skip
        got = _record(llm)
        assert _generate(llm, GREEDY) == plain
        if in_flight == 1:
            assert got == proposed and _counts(llm) == single
        else:
            assert llm.core.batch_counts.overlapped > 0
            mine, theirs = ({str(t): p for t, p in seen} for seen in (got, proposed))
            common = set(mine) & set(theirs)
            assert len(common) >= 0.8 * len(theirs)
            for key in common:
                a, b = sorted((mine[key], theirs[key]), key=len)
                assert b[: len(a)] == a, key
        _sampled_and_clean(llm, single, speculates=True)


def test_whole_vocab_tables_equal_the_model(setup, monkeypatch):
    """One rank: the gathered tables are the model's embedding and LM head (the same lookups and
    logits), gathered in chunks that do not divide the vocabulary or the hidden size."""
    monkeypatch.setattr(whole_vocab, "GATHER_IDS", 100)
    monkeypatch.setattr(whole_vocab, "GATHER_ROWS", 24)
    target, _, _ = setup
    with LLM(target, max_model_len=64) as llm:
        model = llm.core.runner.model
        whole = WholeVocab.gather(model, True, torch.device("cpu"))
        ids = torch.tensor([0, 3, 511, 200])
        hidden = torch.randn(5, model.arch.hidden_size)
        with torch.inference_mode():
            assert torch.equal(whole.token_embeddings(ids), model.token_embeddings(ids))
            torch.testing.assert_close(whole.compute_logits(hidden), model.compute_logits(hidden))
