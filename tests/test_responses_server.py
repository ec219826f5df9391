"""The Responses API (`/v1/responses`) and reasoning usage through `llmserve serve --reasoning-parser
deepseek_r1` and the official openai client. The tiny model does not think by itself: a regex that
spells out `<think>...</think>` and the answer holds it to the format (as in test_reasoning_server)."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
from server_utils import start_server

from llmserve.config import TINY_MODEL_DIR

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
THOUGHTS = r"<think>\nI see [a-z]{3,6}\.\n</think>\n\nThe answer is [0-9]\."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model, its chat template showing the tools."""
    model = tmp_path_factory.mktemp("responses") / "model"
    shutil.copytree(TINY_MODEL_DIR, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{%- if tools %}<|system|>\nTools: {{ tools | tojson }}<|end|>{%- endif %}" + config["chat_template"]
    )
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


@pytest.fixture(scope="module")
def server(model_dir):
    srv = start_server([str(model_dir), "--max-model-len", "512", "--served-model-name", "tiny", "--reasoning-parser",
                        "deepseek_r1", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                       str(model_dir.parent / "server.log"))  # fmt: skip
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def detokenize(client, ids: list[int]) -> str:
    return client.post("/../detokenize", body={"tokens": ids}, cast_to=object)["prompt"]


def test_chat_usage_counts_reasoning_tokens(client):
    """The thoughts' tokens: those up to the one that completes `</think>`, streamed or not."""
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=120, temperature=0,
              extra_body={"guided_regex": THOUGHTS, "return_token_ids": True})  # fmt: skip
    done = client.chat.completions.create(**kw)
    ids, usage = done.choices[0].token_ids, done.usage
    k = usage.completion_tokens_details.reasoning_tokens
    assert 0 < k < usage.completion_tokens == len(ids)
    assert "</think>" in detokenize(client, ids[:k]) and "</think>" not in detokenize(client, ids[: k - 1])
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == k
    assert chunks[-1].usage.completion_tokens == usage.completion_tokens
    cut = client.chat.completions.create(**{**kw, "max_tokens": 8})  # never closed: every token is a thought
    assert cut.usage.completion_tokens_details.reasoning_tokens == 8 == cut.usage.completion_tokens
