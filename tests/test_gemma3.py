"""Gemma 3 270M from its GGUF (issue 50): llmserve's greedy tokens equal transformers' loading the
same file in float32, on prompts shorter and longer than the 512-token window, with prefix
caching, chunked prefill and preemption on in one engine, and through `llmserve serve`.
Skipped when the model's four PyPI packages are not installed (tests/gemma3_oracle.py)."""

from __future__ import annotations

import pytest
from gemma3_oracle import gemma3_gguf, greedy_tokens, hf_gemma3

from llmserve import LLM, SamplingParams

# a fresh machine's first test converts the GGUF for transformers once (about 4 minutes on 2 busy
# cores, tests/gemma3_oracle.py) inside its fixtures: more than the suite's 300 s a test
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

MAX_NEW = 8
SHORT = "The capital of France is"
# about 830 and 640 tokens: past the window, so the sliding layers see only the last 512
LONG = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog number {i}." for i in range(45))
LONG2 = " ".join(f"Step {i}: add {i} to the running total, then write the total down." for i in range(40))


@pytest.fixture(scope="module")
def prompts():
    _, tokenizer = hf_gemma3()
    ids = [tokenizer(text)["input_ids"] for text in (SHORT, LONG, LONG2)]
    assert len(ids[0]) < 512 < min(len(ids[1]), len(ids[2]))
    return ids


@pytest.fixture(scope="module")
def references(prompts):
    return [greedy_tokens(p, MAX_NEW, ignore_eos=True) for p in prompts]


@pytest.fixture(scope="module")
def llm():
    # every feature at once: prefix caching, prompts in chunks of 96 tokens, and a KV budget of 300
    # block ids (a block id holds 16 tokens of one KV group's 3 layers: engine/kv_layout.py) for
    # sequences of ~14, ~840 and ~650 tokens: one of ~840 holds ~250 (its five windowed groups only
    # their 512-token windows and a chunk), two do not fit, so they preempt each other
    engine = LLM(str(gemma3_gguf()), max_model_len=1024, enable_prefix_caching=True, enable_chunked_prefill=True,
                 max_num_batched_tokens=96, num_gpu_blocks_override=300, admission_reserve_tokens=0, swap_space=0)  # fmt: skip
    yield engine


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_gemma3_matches_transformers_short_and_past_the_window(llm, prompts, references):
    assert _greedy(llm, prompts) == references
    assert llm.stats().num_preemptions > 0, "the KV budget was meant to force preemption"
    # the long prompt alone, then again: the second time its blocks come from the prefix cache
    # (the global layers' blocks and the windowed layers' last window before its end)
    assert _greedy(llm, prompts[1:2]) == references[1:2]
    hits = llm.stats().prefix_cache_hits
    assert _greedy(llm, prompts[1:2]) == references[1:2]
    assert llm.stats().prefix_cache_hits - hits >= len(prompts[1]) - 16


def test_gemma3_text_is_the_detokenized_tokens(llm, prompts, references):
    _, tokenizer = hf_gemma3()
    out = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                                                          ignore_eos=True), use_tqdm=False)[0]  # fmt: skip
    assert out.outputs[0].text == tokenizer.decode(references[0])
    assert out.outputs[0].text.startswith(" the capital of the country of France")


def test_gemma3_serves_through_llmserve_serve(tmp_path, prompts, references):
    """The OpenAI server on the GGUF: completions give transformers' text; chat completions are
    refused with a clear 400, since this base model's GGUF carries no chat template."""
    import openai
    from server_utils import start_server

    _, tokenizer = hf_gemma3()
    server = start_server(["--model", str(gemma3_gguf()), "--max-model-len", "1024"], str(tmp_path / "serve.log"),
                          timeout=600)  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        model = client.models.list().data[0].id
        done = client.completions.create(model=model, prompt=SHORT, max_tokens=MAX_NEW, temperature=0,
                                         extra_body={"ignore_eos": True})  # fmt: skip
        assert done.choices[0].text == tokenizer.decode(references[0])
        assert done.usage.prompt_tokens == len(prompts[0])
        with pytest.raises(openai.BadRequestError, match="chat template"):
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    finally:
        server.stop()
