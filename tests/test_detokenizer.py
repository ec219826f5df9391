"""Incremental detokenization equals a full decode; stop strings cut and hold back."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from llmserve.engine import detokenizer as detok_mod
from llmserve.engine.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.unit

TEXT = "Héllo wörld — naïve café ☕ déjà vu, 1 + 1 = 2\nnew line  two spaces"


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


@pytest.mark.parametrize("fast", [True, False])
def test_incremental_equals_full_decode(tokenizer, monkeypatch, fast):
    if not fast:
        monkeypatch.setattr(detok_mod, "DecodeStream", None)
    prompt = tokenizer.encode("prompt text")
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, True, [], False)
    assert (detok._stream is not None) == (fast and detok_mod.DecodeStream is not None)
    for token in ids:
        detok.add_tokens([token])
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True) == TEXT


def test_stop_string_cut_and_holdback(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1], True, ["café", "zzz"], False)
    stop = None
    for token in ids:
        stop = detok.add_tokens([token])
        visible = detok.visible_text(finished=stop is not None)
        assert "caf" not in visible or stop  # a partial stop string is never shown early
        if stop:
            break
    assert stop == "café" and detok.text == TEXT[: TEXT.index("café")]


@pytest.mark.parametrize("fast", [True, False])
def test_a_prompt_ending_inside_a_character_adds_only_what_the_output_adds(tokenizer, monkeypatch, fast):
    """Issue 49: token ids that end inside a character (an emoji's first bytes) made the first
    output text carry the prompt's last tokens' text. The output is what the generated tokens
    add to the decoded prompt: the prompt's text to its last whole character, then the output,
    is the decode of all the tokens (the straddling character completed); cut anywhere, with a
    prompt of one token, and with an output that ends inside a character (shown as a decode
    shows it once the output ends)."""
    if not fast:
        monkeypatch.setattr(detok_mod, "DecodeStream", None)
    ids = tokenizer.encode("The json module 😀 and 中文 ☕ ok", add_special_tokens=False)
    cut_inside = 0
    for cut in range(1, len(ids)):
        for prompt in (ids[:cut], ids[cut - 1 : cut]):
            for end in range(cut + 1, len(ids) + 1):
                output = ids[cut:end]
                detok = IncrementalDetokenizer(tokenizer, prompt, True, [], False)
                for token in output:
                    detok.add_tokens([token])
                detok.flush()
                decoded = tokenizer.decode(prompt)
                cut_inside += decoded.endswith("\ufffd")
                want = tokenizer.decode(prompt + output)
                assert detok_mod.stable_prompt_text(decoded) + detok.text == want, (prompt, output)
    assert cut_inside >= 6  # the cases of the issue were met
