"""The offline `LLM` API on a small random model: prefix caching, sampling, stops, n, dtypes."""

from __future__ import annotations

import functools
import json
import shutil
import time

import pytest
import torch
from conftest import assert_no_leak, hf_greedy

from llmserve import LLM, SamplingParams
from llmserve.config import ConfigError
from llmserve.engine.input_processor import PromptError, PromptTooLongError
from llmserve.engine.logits_rows import warm_counts
from llmserve.engine.warmup_pool import WarmupPool
from llmserve.model.arch import UnsupportedModelError
from llmserve.sampling_params import SamplingParamsError

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, max_model_len=256, block_size=16)


def ids(*tokens):
    return {"prompt_token_ids": list(tokens)}


def test_prefix_hit_computes_only_new_tokens(llm):
    shared = list(range(10, 58))  # exactly 3 blocks of 16
    llm.generate([ids(*shared, 70, 71)], GREEDY, use_tqdm=False)
    before = llm.stats()
    out = llm.generate([ids(*shared, 80, 81, 82)], GREEDY, use_tqdm=False)[0]
    after = llm.stats()
    assert out.num_cached_tokens == 48
    assert after.prefix_cache_hits - before.prefix_cache_hits == 48
    assert after.prefix_cache_queries - before.prefix_cache_queries == 51
    # 3 new prompt tokens, then 7 decode steps of 1 token
    assert after.num_computed_tokens_total - before.num_computed_tokens_total == 3 + 7
    assert_no_leak(llm)


def test_cached_prefix_gives_same_tokens(llm):
    prompt = ids(*range(100, 150))
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    second = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens == 48
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_seeded_sampling_independent_of_batch(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([ids(1, 5, 6, 7)], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [ids(1, 9, 9), ids(1, *range(200, 240)), ids(1, 5, 6, 7), ids(1, 3)]
    mixed = [SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)] * 2 + [params] * 2
    batch = llm.generate(others, mixed, use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    unseeded = llm.generate([ids(1, 5, 6, 7)] * 2, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_n_samples_share_prompt_blocks(llama_dir):
    llm = LLM(llama_dir, max_model_len=256, enable_prefix_caching=False)
    prompt = list(range(10, 50))  # 40 tokens: 2 shareable blocks + 8
    before = llm.stats().num_computed_tokens_total
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)
    out = llm.generate([ids(*prompt)], params, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 5 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # siblings sample differently
    computed = llm.stats().num_computed_tokens_total - before
    assert computed == 40 + 2 * 8 + 3 * 4  # prompt once, siblings only their tail
    assert_no_leak(llm)


def test_stop_strings_and_tokens(llm):
    free = llm.generate([ids(1, 20, 21)], GREEDY, use_tqdm=False)[0].outputs[0]
    text = free.text
    assert len(text) > 4
    stop = text[2:4]
    cut = llm.generate(
        [ids(1, 20, 21)], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    kept = llm.generate(
        [ids(1, 20, 21)],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=stop, include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]
    tok = free.token_ids[3]
    by_id = llm.generate(
        [ids(1, 20, 21)], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[tok]), use_tqdm=False
    )[0].outputs[0]
    assert by_id.token_ids == free.token_ids[: free.token_ids.index(tok) + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == tok
    assert_no_leak(llm)


def test_max_tokens_min_tokens_and_logprobs(llm):
    out = llm.generate(["hello world"], SamplingParams(max_tokens=5, min_tokens=5, logprobs=3), use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.token_ids) == 5 and comp.finish_reason == "length"
    assert len(comp.logprobs) == 5
    for token, entry in zip(comp.token_ids, comp.logprobs):
        assert token in entry and len(entry) >= 3
    assert comp.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs)))
    assert out.prompt == "hello world" and out.prompt_token_ids
    again = llm.generate(["hello world"], SamplingParams(max_tokens=5, logprobs=3), use_tqdm=False)[0].outputs[0]
    for sample in (comp, again):  # (a token's text is decoded once, then cached: the second run reads the cache)
        texts = {tid: e.decoded_token for entry in sample.logprobs for tid, e in entry.items()}
        assert texts == {tid: llm.tokenizer.decode([tid]) for tid in texts}


def test_generation_stops_at_max_model_len(llama_dir):
    llm = LLM(llama_dir, max_model_len=32)
    out = llm.generate([ids(*range(10, 40))], SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "make_params, error",
    [
        (lambda: SamplingParams(max_tokens=0), "max_tokens must be at least 1"),
        (lambda: SamplingParams(top_p=0.0), "top_p must be in (0, 1]"),
        (lambda: SamplingParams(top_p=1.5), "top_p must be in (0, 1]"),
        (lambda: SamplingParams(temperature=-0.1), "temperature must be a finite number >= 0"),
        (lambda: SamplingParams(temperature=float("inf")), "temperature must be a finite number >= 0"),
        (lambda: SamplingParams(repetition_penalty=float("inf")), "repetition_penalty must be a finite number > 0"),
        (lambda: SamplingParams(temperature=float("nan")), "temperature must be a finite number >= 0"),
        (lambda: SamplingParams(n=0), "n must be in [1, 128]"),
        (lambda: SamplingParams(n=129), "n must be in [1, 128]"),
        (lambda: SamplingParams(seed=2**64), "seed must be a 64-bit integer"),
        (lambda: SamplingParams(logprobs=50), "logprobs must be in [0, 20]"),
        (lambda: SamplingParams(min_tokens=5, max_tokens=2), "min_tokens (5) must be <= max_tokens (2)"),
    ],
)
def test_bad_sampling_params(make_params, error):
    with pytest.raises(SamplingParamsError) as exc:
        make_params()
    assert error in str(exc.value)


def test_bad_prompts_raise_and_engine_keeps_serving(llm):
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        llm.generate([ids(*([5] * 300))], GREEDY, use_tqdm=False)
    with pytest.raises(PromptError, match="empty"):
        llm.generate([ids()], GREEDY, use_tqdm=False)
    with pytest.raises(PromptError, match="vocabulary"):
        llm.generate([ids(1, 999999)], GREEDY, use_tqdm=False)
    with pytest.raises(PromptError):
        llm.generate([{"text": "x"}], GREEDY, use_tqdm=False)
    # a bad prompt in a batch queues nothing; the engine still serves
    with pytest.raises(PromptTooLongError):
        llm.generate([ids(1, 2, 3), ids(*([5] * 300))], GREEDY, use_tqdm=False)
    assert_no_leak(llm)
    out = llm.generate([ids(1, 2, 3)], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


def test_bad_model_folders(tmp_path, llama_dir):
    with pytest.raises(ConfigError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))
    bad = tmp_path / "gpt2like"
    shutil.copytree(llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="supported: LlamaForCausalLM"):
        LLM(str(bad))
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(llama_dir, max_num_sequences=4)
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(llama_dir, max_model_len=100000)
    with pytest.raises(ConfigError, match="KV cache holds"):
        LLM(llama_dir, max_model_len=256, num_gpu_blocks_override=4)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_agrees_mostly_with_float32(llama_dir, dtype):
    ref = LLM(llama_dir, max_model_len=128).generate([ids(1, 50, 60, 70)], GREEDY, use_tqdm=False)
    half = LLM(llama_dir, max_model_len=128, dtype=dtype)
    assert half.core.runner.model.model.embed_tokens.weight.dtype == getattr(torch, dtype)
    out = half.generate([ids(1, 50, 60, 70)], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids[:2] == ref[0].outputs[0].token_ids[:2]


def test_sharded_checkpoint_loads(tmp_path, llama_dir):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    model.save_pretrained(sharded, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{llama_dir}/{f}", sharded / f)
    assert (sharded / "model.safetensors.index.json").exists()
    prompt = [1, 40, 41, 42]
    want = hf_greedy(llama_dir, [prompt], 6)[0]
    got = LLM(str(sharded), max_model_len=64).generate(
        [ids(*prompt)], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False
    )
    assert got[0].outputs[0].token_ids == want


def test_dummy_weights(llama_dir):
    llm = LLM(llama_dir, load_format="dummy", max_model_len=64)
    out = llm.generate([ids(1, 2, 3)], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_string_prompts_and_vllm_style_script(llama_dir):
    llm = LLM(model=llama_dir, max_model_len=128)
    outputs = llm.generate(["Hello, my name is", "The capital of"], SamplingParams(temperature=0.8, top_p=0.95))
    assert len(outputs) == 2
    for output in outputs:
        assert isinstance(output.outputs[0].text, str) and output.outputs[0].token_ids


def test_tiny_model_matches_transformers_and_reads_as_text():
    from llmserve.config import TINY_MODEL_DIR

    llm = LLM(str(TINY_MODEL_DIR), max_model_len=256)  # the tiny model shipped for tests
    tok = llm.get_tokenizer()
    prompts = [tok.encode("The json module"), tok.encode("To open a file")]
    want = hf_greedy(str(TINY_MODEL_DIR), prompts, 20)
    outs = llm.generate([ids(*p) for p in prompts], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    text = outs[0].outputs[0].text
    words = [w for w in text.split() if w.strip('".,():').isalpha()]
    assert len(words) >= 5, text  # language, not noise
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What does `os.getcwd` do?"}], add_generation_prompt=True, tokenize=False
    )
    answer = llm.generate(
        [ids(*tok.encode(chat, add_special_tokens=False))], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False
    )[0]
    assert answer.outputs[0].finish_reason == "stop" and answer.outputs[0].text.strip()
    # vLLM's LLM.chat: the same conversation through the template gives the same reply
    question = [{"role": "user", "content": "What does `os.getcwd` do?"}]
    replies = llm.chat([question, question + [{"role": "assistant", "content": "It returns a path."},
                                              {"role": "user", "content": "Which one?"}]],
                       SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)  # fmt: skip
    assert replies[0].outputs[0].token_ids == answer.outputs[0].token_ids and len(replies) == 2
    assert len(replies[1].prompt_token_ids) > len(replies[0].prompt_token_ids)
    assert (
        llm.chat(question, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0].text
        == answer.outputs[0].text
    )
    # read as the OpenAI server reads messages: text parts joined
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What does "}, {"type": "text", "text": "`os.getcwd` do?"}],
        }
    ]
    assert (
        llm.chat(parts, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].prompt_token_ids
        == answer.prompt_token_ids
    )
    with pytest.raises(ValueError):
        llm.chat([])
    with pytest.raises(ValueError):
        llm.chat([{"role": "wizard", "content": "hi"}])


def test_chat_history_tool_calls_reach_the_template_as_objects(llm):
    """As vLLM's LLM.chat: an earlier call's arguments (JSON text in the OpenAI shape) reach
    the template as an object, which templates render with `tojson`."""
    tok = llm.get_tokenizer()
    saved = tok.chat_template
    tok.chat_template = ("{% for m in messages %}{% for c in m.tool_calls or [] %}"
                         "{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}")  # fmt: skip
    try:
        history = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}]  # fmt: skip
        out = llm.chat(history, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    finally:
        tok.chat_template = saved
    assert tok.decode(out.prompt_token_ids) == '{"a": 1}'  # an object, not the string "{\"a\": 1}"


def test_chat_without_a_template_is_a_clear_error(llm):
    import copy

    from llmserve.chat_template import NoChatTemplateError, render_chat

    tok = copy.copy(llm.get_tokenizer())
    tok.chat_template = None
    with pytest.raises(NoChatTemplateError, match="no chat template"):
        render_chat(tok, [{"role": "user", "content": "hi"}])


def test_stop_token_ids_are_kept_once_each():
    """A million repeated ids were masked on every step; each counts once."""
    assert SamplingParams(stop_token_ids=[5, 7, 5] * 1000).stop_token_ids == [5, 7]
    with pytest.raises(SamplingParamsError, match="at most 256 stop strings"):
        SamplingParams(stop=[f"s{i}" for i in range(257)])


def test_scheduler_budgets_default_by_device_and_command(monkeypatch, llama_dir):
    """No --max-num-seqs / --max-num-batched-tokens: offline, vLLM's choices by device (a large
    GPU: 1024 sequences and 16384 tokens; a smaller GPU 256 and 8192; a CPU 256 and 2048); a
    server keeps 256 and 2048; given values win; the caller is not a user flag."""
    import argparse
    import types

    from llmserve.cli_args import add_engine_args, engine_args_from_cli
    from llmserve.config import ConfigError, EngineArgs, default_budgets

    assert default_budgets("cpu", "llm") == default_budgets("cpu", "api_server") == (256, 2048)
    for memory, want in ((141 << 30, {"llm": (1024, 16384), "api_server": (256, 2048)}),
                         (24 << 30, {"llm": (256, 8192), "api_server": (256, 2048)})):  # fmt: skip
        monkeypatch.setattr(
            torch.cuda, "get_device_properties", lambda _i, m=memory: types.SimpleNamespace(total_memory=m)
        )
        assert {ctx: default_budgets("cuda", ctx) for ctx in want} == want
    with pytest.raises(ConfigError, match="usage_context"):
        default_budgets("cpu", "browser")
    sc = EngineArgs(model=llama_dir, device="cpu").create_engine_config().scheduler_config
    assert (sc.max_num_seqs, sc.max_num_batched_tokens) == (256, 2048)
    sc = (
        EngineArgs(model=llama_dir, device="cpu", max_num_seqs=7, max_num_batched_tokens=300)
        .create_engine_config()
        .scheduler_config
    )
    assert (sc.max_num_seqs, sc.max_num_batched_tokens) == (7, 300)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert "--usage-context" not in parser.format_help()
    assert engine_args_from_cli(parser.parse_args([]), "api_server").usage_context == "api_server"


def test_the_core_checks_requests_with_the_fronts_own_check(llm):
    """One request check: what the front raises as PromptError (a 400), the engine core
    answers with an error output carrying the same message when a request reaches it
    directly; a duplicate id is refused too."""
    from llmserve.engine.request import EngineCoreRequest

    core, max_len = llm.core, llm.config.model_config.max_model_len
    params = SamplingParams(max_tokens=2)
    for ids in ([], [1] * max_len, [1, 10**9]):
        with pytest.raises(PromptError) as front:
            llm.input_processor.process("x", {"prompt_token_ids": ids}, params)
        out = core.add_request(EngineCoreRequest("direct", ids, params, 2, (2,)))
        assert out.finish_reason == "abort" and out.error == str(front.value)
    assert core.add_request(EngineCoreRequest("twice", [1, 2], params, 2, (2,))) is None
    assert "already in use" in core.add_request(EngineCoreRequest("twice", [1, 2], params, 2, (2,))).error
    core.abort_requests(["twice"])


def test_the_core_checks_the_ids_again_only_when_the_front_did_not(llm, monkeypatch):
    """The front's requests say which vocabulary their ids were checked against; the core
    skips its own pass over them only for its own vocabulary size (a direct driver, or a
    front that says nothing or checked another vocabulary, is checked)."""
    from llmserve.engine import input_processor, request_checks
    from llmserve.engine.request import EngineCoreRequest

    vocab = llm.config.model_config.arch.vocab_size
    params = SamplingParams(max_tokens=2)
    (sent,) = llm.input_processor.process("front", {"prompt_token_ids": [1, 2, 3]}, params).core_requests
    assert sent.ids_checked_vocab == vocab
    (from_text,) = llm.input_processor.process("text", "hello there", params).core_requests
    assert from_text.ids_checked_vocab == vocab  # the tokenizer's ids are checked by `process` too
    passes = []
    real = request_checks.check_token_ids
    monkeypatch.setattr(request_checks, "check_token_ids", lambda ids, v: passes.append(len(ids)) or real(ids, v))
    monkeypatch.setattr(input_processor, "check_token_ids", request_checks.check_token_ids)
    llm.input_processor.process("both", {"prompt_token_ids": [1, 2, 3, 4], "prompt": "abcd"}, params)
    assert passes == [4]  # ids given beside their text: one pass in the front
    passes.clear()
    assert llm.core.add_request(sent) is None
    assert passes == []
    for claimed in (None, vocab + 1):
        out = llm.core.add_request(
            EngineCoreRequest(f"bad-{claimed}", [1, vocab], params, 2, (2,), ids_checked_vocab=claimed)
        )
        assert out.finish_reason == "abort" and "outside the vocabulary" in out.error
    assert passes == [2, 2]
    llm.core.abort_requests(["front"])


def test_a_tokenizers_ids_outside_the_models_vocabulary_are_refused(llm, monkeypatch):
    """A tokenizer with more tokens than the model's embedding: its ids are checked like given ones."""
    vocab = llm.config.model_config.arch.vocab_size
    monkeypatch.setattr(llm.input_processor.tokenizer, "encode", lambda text, **kw: [1, vocab + 3])
    with pytest.raises(PromptError, match=f"prompt token id {vocab + 3} is outside the vocabulary"):
        llm.input_processor.process("big", "hello", SamplingParams(max_tokens=2))


def test_a_batch_is_queued_while_its_first_steps_run(llama_dir, tmp_path, monkeypatch):
    """`generate` queues a few steps' worth of prompt tokens, launches, and queues the rest a
    step's worth at a time while the device runs: the steps (requests, tokens, prompt tokens of
    each, from the step timing log) and the tokens are those of queueing everything first. A
    request the core refuses mid-feed fails the call and leaves nothing behind."""
    import random

    from llmserve.engine import request_feed
    from llmserve.engine.engine_core import StepPipeline

    rng = random.Random(3)
    prompts = [ids(*(rng.randrange(1, 200) for _ in range(rng.randrange(5, 40)))) for _ in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    runs, launch = {}, StepPipeline.launch
    for name, lead in (("fed", request_feed.LEAD_STEPS), ("all first", 10**9)):
        log = tmp_path / f"{name}.jsonl"
        llm = LLM(llama_dir, max_model_len=256, block_size=16, max_num_batched_tokens=64, max_num_seqs=8,
                  step_timing_log=str(log))  # fmt: skip
        events, add = [], llm.core.add_request
        monkeypatch.setattr(
            llm.core, "add_request", lambda req, add=add, events=events: events.append("add") or add(req)
        )
        monkeypatch.setattr(StepPipeline, "launch", lambda self, events=events: events.append("launch") or launch(self))
        monkeypatch.setattr(request_feed, "LEAD_STEPS", lead)
        out = llm.generate(prompts, params, use_tqdm=False)
        steps = [(s["reqs"], s["tokens"], s["prefill"]) for s in map(json.loads, log.read_text().splitlines())]
        runs[name] = ([o.outputs[0].token_ids for o in out], steps, events)
        assert_no_leak(llm)
    fed, first = runs["fed"], runs["all first"]
    assert fed[0] == first[0] and fed[1] == first[1]
    assert first[2].index("launch") == 40  # everything queued before the first step
    assert 0 < fed[2].index("launch") < 40 and fed[2][-1] == "launch"  # the rest queued between steps
    # a refusal in the middle of the feed: RequestFailedError, no request or block left
    from llmserve.engine.output_processor import RequestFailedError
    from llmserve.engine.request import EngineCoreOutput

    monkeypatch.setattr(request_feed, "LEAD_STEPS", 1)
    calls = []
    monkeypatch.setattr(llm.core, "add_request", lambda req: (
        EngineCoreOutput(req.request_id, [], finish_reason="abort", error="refused")
        if len(calls) == 30 else calls.append(1) or add(req)))  # fmt: skip
    with pytest.raises(RequestFailedError, match="refused"):
        llm.generate(prompts, params, use_tqdm=False)
    assert_no_leak(llm)
    monkeypatch.setattr(llm.core, "add_request", add)
    assert llm.generate(prompts[:2], params, use_tqdm=False)[0].outputs[0].token_ids == first[0][0]


def test_lm_head_and_sampler_warm_up_leave_nothing_behind(llm):
    """The warm-up of the LM head's row counts and of each sampling path (run on a GPU at start)
    runs here too, forgets its dummy requests, and the engine then gives the same tokens."""
    before = llm.generate([ids(5, 6, 7)], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    runner = llm.core.runner
    batches, sample = [], runner.sampler.sample_async
    runner.sampler.sample_async = lambda logits, reqs, *a: (
        batches.append([r.sampling_params for r in reqs]) or sample(logits, reqs, *a)
    )
    try:
        assert runner._warm_lm_head() == len(warm_counts(llm.config.scheduler_config.max_num_seqs))
    finally:
        del runner.sampler.sample_async
    # each path alone and beside another kind of row (the sampling kernels' variants: rows picked
    # out of the batch for the race, repetition and presence penalties in one launch)
    assert any(len(b) == 2 and b[0].greedy and not b[1].greedy for b in batches)
    assert any(len(b) == 2 and b[0].repetition_penalty != 1.0 and b[1].presence_penalty for b in batches)
    assert runner.sampler._plan is None  # forgotten: no plan (nor its logit-bias tensors) kept
    assert runner.sampler.penalties is not None and not runner.sampler.penalties.slot_of  # the penalty paths ran
    assert llm.generate([ids(5, 6, 7)], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before
    # on a pool's threads (as on a GPU) each batch has a sampler of its own: the runner's is left alone
    plan, penalties, slots = runner.sampler._plan, runner.sampler.penalties, dict(runner.sampler.penalties.slot_of)
    runner.sampler.sample_async = lambda *a: pytest.fail("the runner's own sampler ran on a thread")
    try:
        with WarmupPool(runner.device, workers=3) as pool:
            assert runner._warm_lm_head(pool) == len(warm_counts(llm.config.scheduler_config.max_num_seqs))
    finally:
        del runner.sampler.sample_async
    assert pool.busy_s > 0 and runner.sampler._plan is plan and runner.sampler.penalties is penalties
    assert runner.sampler.penalties.slot_of == slots
    assert llm.generate([ids(5, 6, 7)], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before


def test_a_warmup_pool_runs_units_on_its_threads_and_reports_the_first_failure():
    """Units run on the pool's threads in inference mode and are all done when the `with` block
    ends; a failing unit does not stop the others, and its error is raised at the end. One worker
    runs each unit at once in the caller's thread (the reference)."""
    import threading

    seen, done = [], []

    def unit(i):
        seen.append((threading.current_thread().name, torch.is_inference_mode_enabled()))
        if i == 2:
            raise ValueError("unit 2 failed")
        time.sleep(0.05)
        done.append(i)
        return i * i

    with pytest.raises(ValueError, match="unit 2 failed"):
        with WarmupPool(torch.device("cpu"), workers=3) as pool:
            futures = [pool.submit(functools.partial(unit, i)) for i in range(6)]
    assert sorted(done) == [0, 1, 3, 4, 5] and all(name.startswith("warmup") and inf for name, inf in seen)
    assert [f.result() for f in futures if f.exception() is None] == [0, 1, 9, 16, 25]
    seen.clear()
    with WarmupPool(torch.device("cpu"), workers=1) as pool:
        assert pool.submit(functools.partial(unit, 3)).result() == 9
    assert seen == [(threading.current_thread().name, True)]
    assert WarmupPool(torch.device("cpu")).workers == 1  # the interpreter is not thread-safe: CPU runs inline


def test_flat_logprobs_read_as_the_dicts_they_replace():
    """A `LogprobStore` read through `FlatLogprobs` gives, token by token, the {id: Logprob} dict the
    output processor used to build (top-k ranked 1..k, then the sampled token with its own rank,
    replacing its top-k entry); a view keeps its length while the store grows; slices, negative
    indices, equality with a list and pickling work as on a list."""
    import pickle

    from llmserve.outputs import FlatLogprobs, Logprob, LogprobStore

    text = {3: "c", 5: "e", 9: "i", 11: "k"}.__getitem__
    steps = [(5, -0.1, 1, [(5, -0.1), (3, -2.5)]), (11, -4.0, 7, [(9, -0.3), (3, -1.9)]), (3, -0.7, 1, [])]
    store = LogprobStore()
    for token, value, rank, top in steps[:2]:
        store.add(token, value, rank, top, text)
    view = store.view()
    store.add(*steps[2], text)
    want = []
    for token, value, rank, top in steps:
        entry = {tid: Logprob(v, r + 1, text(tid)) for r, (tid, v) in enumerate(top)}
        entry[token] = Logprob(value, rank, text(token))
        want.append(entry)
    assert len(view) == 2 and list(view) == want[:2] and view == want[:2]
    full = store.view()
    assert full == want and full[-1] == want[2] and full[1:] == want[1:] and list(full[5:]) == []
    assert list(full[0]) == [5, 3] and full[0][5] == Logprob(-0.1, 1, "e")
    assert pickle.loads(pickle.dumps(full)) == want
    with pytest.raises(IndexError):
        full[3]
    assert isinstance(full, FlatLogprobs) and full != want[:2]
