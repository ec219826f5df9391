"""Load a model's tokenizer: from a Hugging Face folder, or from a GGUF file's metadata
(tokens, merges, special tokens and chat template, converted by transformers)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    source = Path(path)
    if source.is_file():  # a GGUF file (config.py let no other file through)
        return AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    return AutoTokenizer.from_pretrained(path)
