"""Prompt logprobs (vLLM's `SamplingParams(prompt_logprobs=k)`), computed on the device from the
prompt rows' logits, against the reference: the log-softmax of transformers' logits over the
whole prompt (float32). Chunked prefill, a cached prefix, n samples and preemption do not
change them; a step without a request that asks does no prompt-logprobs work."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_leak

from llmserve import LLM, SamplingParams
from llmserve.engine import model_runner
from llmserve.engine.input_builder import RowInput
from llmserve.engine.prompt_logprobs import compute_prompt_logprobs, prompt_rows
from llmserve.sampling_params import SamplingParamsError

pytestmark = pytest.mark.unit

PROMPTS = [list(range(10, 60)), [1, 7, 300, 42, 42, 9], [5, 6], [77]]


@pytest.fixture(scope="module")
def reference(llama_dir):
    """Each prompt's log-softmax at every position, from transformers (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return {tuple(p): torch.log_softmax(model(torch.tensor([p])).logits[0].float(), dim=-1) for p in PROMPTS}


def _check(out, prompt: list[int], reference: dict, k: int) -> None:
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt) and lps[0] is None
    ref = reference[tuple(prompt)]
    for p in range(1, len(prompt)):
        entry, row = lps[p], ref[p - 1]
        token = prompt[p]
        assert token in entry and len(entry) in (k, k + 1)
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=2e-4)
        assert entry[token].rank == 1 + int((row > row[token]).sum())
        top = sorted((e for e in entry.values() if e.rank <= k), key=lambda e: e.rank)
        assert [e.logprob for e in top] == pytest.approx(row.topk(k).values.tolist(), abs=2e-4)
        assert [t for t, e in sorted(entry.items(), key=lambda x: x[1].rank) if e.rank <= k] == row.topk(
            k
        ).indices.tolist()


@pytest.mark.parametrize("config", [
    dict(),
    dict(max_num_batched_tokens=16, max_num_seqs=4),  # chunked prefill: the 50-token prompt in 4 chunks
    dict(enable_prefix_caching=False, async_scheduling=False),
])  # fmt: skip
def test_prompt_logprobs_equal_the_full_forwards_log_softmax(llama_dir, reference, config):
    llm = LLM(llama_dir, max_model_len=128, dtype="float32", **config)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=3)
    for _ in range(2):  # the second time, the prompts' blocks are in the prefix cache: not used for these
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        for out, prompt in zip(outs, PROMPTS):
            _check(out, prompt, reference, 3)
    plain = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None
    assert_no_leak(llm)


def test_prompt_logprobs_of_n_samples_and_after_preemption(llama_dir, reference):
    """n samples: the prompt's logprobs once; a request preempted mid-way (a KV cache of 14
    blocks of 8 for 4 prompts) recomputes its prompt and still gives each position once."""
    llm = LLM(llama_dir, max_model_len=112, dtype="float32", block_size=8, num_gpu_blocks_override=14,
              max_num_batched_tokens=16, max_num_seqs=4, admission_reserve_tokens=0)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=2)
    before = llm.stats().num_preemptions
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert llm.stats().num_preemptions > before
    for out, prompt in zip(outs, PROMPTS):
        _check(out, prompt, reference, 2)
    many = llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(n=3, max_tokens=2, prompt_logprobs=1),
                        use_tqdm=False)[0]  # fmt: skip
    assert len(many.outputs) == 3
    _check(many, PROMPTS[1], reference, 1)
    assert_no_leak(llm)


def test_a_step_without_a_request_that_asks_does_no_prompt_logprobs_work(llama_dir, monkeypatch):
    llm = LLM(llama_dir, max_model_len=128)

    def refuse(*args):
        raise AssertionError("prompt rows looked at")

    monkeypatch.setattr(model_runner, "prompt_rows", refuse)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=3, logprobs=2), use_tqdm=False)
    assert llm.core.runner.requests.prompt_logprobs == {}


@pytest.mark.parametrize("bad", [-1, 21, 1000])
def test_prompt_logprobs_out_of_range_are_refused(bad):
    with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_prompt_rows_of_chunks_and_their_logprobs_by_kernel_and_by_tensor_ops():
    """A step's prompt rows: a chunk in the middle of a prompt, a last chunk (its last row
    samples), a decode row (none); then their logprobs by the one-pass kernel (Triton's
    interpreter here) equal the tensor ops', in slices of ROWS_AT_ONCE rows."""
    tokens = list(range(100, 140))
    rows = [RowInput("dec", [0], 39, 1, tokens, True), RowInput("mid", [1], 8, 16, tokens, False),
            RowInput("last", [2], 32, 8, tokens, True)]  # fmt: skip
    asking = {"mid": (40, 2), "last": (40, 9), "dec": (40, 1)}
    plan = prompt_rows(rows, [0, 1, 17, 25], asking)
    assert plan.spans == [("mid", 9, 16), ("last", 33, 7)]  # the last row of "last" samples; "dec" is past its prompt
    assert plan.rows == list(range(1, 17)) + list(range(17, 24))
    assert plan.targets == tokens[9:25] + tokens[33:40] and plan.ks == [2] * 16 + [9] * 7
    assert asking == {"mid": (40, 2)}  # the others' prompts are done
    torch.manual_seed(0)
    head = torch.randn(32, 300)
    hidden = torch.randn(25, 32)

    def logits(h):
        return h @ head

    by_ops = compute_prompt_logprobs(logits, hidden, plan, use_kernels=False, pad=False).result()
    ref = torch.log_softmax(logits(hidden), dim=-1)
    first, entries = by_ops["mid"]
    assert first == 9 and len(entries) == 16
    assert entries[0].token_logprob == pytest.approx(ref[1, tokens[9]].item(), abs=1e-5)
    assert [t for t, _ in entries[0].top] == ref[1].topk(2).indices.tolist()
    by_kernel = compute_prompt_logprobs(logits, hidden, plan, use_kernels=True, pad=True, max_rows=5).result()
    for rid in ("mid", "last"):
        (a_first, a), (b_first, b) = by_ops[rid], by_kernel[rid]
        assert a_first == b_first and len(a) == len(b)
        for x, y in zip(a, b):
            assert x.token_logprob == pytest.approx(y.token_logprob, abs=1e-5) and x.token_rank == y.token_rank
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_the_core_keeps_each_prompt_position_once():
    """A chunk recomputed after a preemption gives positions the request already has: kept once,
    sent once, with the next token."""
    from llmserve.engine.request import EngineCoreRequest, Request, TokenLogprobs
    from llmserve.engine.scheduler import _keep_prompt_logprobs, _take_prompt_logprobs

    req = Request(EngineCoreRequest("r", list(range(10)), SamplingParams(prompt_logprobs=1), 4, (0,)))
    entry = [TokenLogprobs(-float(p), 1, []) for p in range(10)]  # entry[p]: position p's
    _keep_prompt_logprobs(req, 1, entry[1:5])
    _keep_prompt_logprobs(req, 1, entry[1:3])  # recomputed
    _keep_prompt_logprobs(req, 3, entry[3:7])
    assert [e.token_logprob for e in req.prompt_logprobs] == [-1, -2, -3, -4, -5, -6]
    assert _take_prompt_logprobs(req) == entry[1:7] and req.prompt_logprobs == []
    _keep_prompt_logprobs(req, 1, entry[1:10])  # recomputed after its first token
    assert _take_prompt_logprobs(req) == entry[7:10] and req.prompt_logprobs_sent == 9
