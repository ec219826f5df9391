"""Load a model's tokenizer: from a Hugging Face folder, or from a GGUF file's metadata
(tokens, merges, special tokens and chat template, converted by transformers).

The conversion of a GGUF's vocabulary is slow for large ones (Gemma 3's 262,144 tokens take
minutes on two CPU cores), so the converted tokenizer is saved once under the cache folder,
keyed by the file's path, size and modification time and by the transformers version, and
read from there afterwards. A cache that cannot be written is skipped.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from llmserve.model.gguf.split_parts import cache_dir

logger = logging.getLogger(__name__)


def load_tokenizer(path: str, cache: Path | None = None) -> PreTrainedTokenizerBase:
    """`cache`: where converted GGUF tokenizers are kept (default: llmserve's cache folder)."""
    source = Path(path)
    if source.is_file():  # a GGUF file (config.py let no other file through)
        return gguf_tokenizer(source, cache_dir() / "tokenizers" if cache is None else cache)
    return AutoTokenizer.from_pretrained(path)


def gguf_tokenizer(source: Path, cache: Path) -> PreTrainedTokenizerBase:
    """The GGUF file's tokenizer: the saved conversion when there is one, else converted and saved."""
    folder = cache / _cache_key(source)
    if (folder / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError) as exc:  # a damaged entry: converted again below
            logger.warning("the cached tokenizer in %s does not load (%s); converting %s again", folder, exc, source)
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    _save(tokenizer, folder)
    return tokenizer


def _cache_key(source: Path) -> str:
    stat = source.stat()
    text = f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _save(tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """Written into a temporary folder beside the entry, then renamed: readers never see half of one."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
        tokenizer.save_pretrained(str(tmp))
        try:
            os.replace(tmp, folder)
        except OSError:  # another process saved it first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        logger.warning("could not cache the converted tokenizer in %s: %s", folder, exc)
