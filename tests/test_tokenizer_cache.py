"""A GGUF's tokenizer is converted once and read back from the cache (llmserve/tokenizer.py): the
cached one encodes, decodes and templates exactly as the conversion does."""

from __future__ import annotations

import pytest

from llmserve.config import default_model_path
from llmserve.tokenizer import _cache_key, load_tokenizer

pytestmark = pytest.mark.unit

TEXTS = ["Hello world", "  leading spaces\nand tabs\t", "The json module 😀", "<|im_start|>user\nhi<|im_end|>",
         "ünïcödé 日本語 ", ""]  # fmt: skip


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    cache = tmp_path_factory.mktemp("tokenizers")
    return load_tokenizer(str(default_model_path()), cache=cache), cache


def test_the_cached_tokenizer_is_the_converted_one(converted):
    fresh, cache = converted
    entry = cache / _cache_key(default_model_path())
    assert (entry / "tokenizer_config.json").is_file()
    cached = load_tokenizer(str(default_model_path()), cache=cache)
    for text in TEXTS:
        ids = fresh(text)["input_ids"]
        assert cached(text)["input_ids"] == ids
        assert cached.decode(ids) == fresh.decode(ids)
        assert cached.convert_ids_to_tokens(ids) == fresh.convert_ids_to_tokens(ids)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert cached.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        fresh.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)  # fmt: skip
    assert (cached.bos_token, cached.eos_token, cached.all_special_ids, len(cached)) == \
        (fresh.bos_token, fresh.eos_token, fresh.all_special_ids, len(fresh))  # fmt: skip


def test_a_damaged_entry_is_converted_again(converted):
    fresh, cache = converted
    entry = cache / _cache_key(default_model_path())
    (entry / "tokenizer.json").write_text("{not json")
    again = load_tokenizer(str(default_model_path()), cache=cache)
    assert again(TEXTS[2])["input_ids"] == fresh(TEXTS[2])["input_ids"]


def test_an_unwritable_cache_still_loads(tmp_path, converted):
    fresh, _ = converted
    blocker = tmp_path / "a-file"  # the cache folder would be inside a file: even root cannot make it
    blocker.write_text("")
    tok = load_tokenizer(str(default_model_path()), cache=blocker / "tokenizers")
    assert tok(TEXTS[0])["input_ids"] == fresh(TEXTS[0])["input_ids"]
