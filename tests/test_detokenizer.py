"""Incremental detokenization equals a full decode; stop strings cut and hold back."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from llmserve.engine import detokenizer as detok_mod
from llmserve.engine.detokenizer import IncrementalDetokenizer

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
