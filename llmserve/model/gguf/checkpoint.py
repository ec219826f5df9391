"""Open a GGUF file (llama.cpp's single-file checkpoint) and say clearly what is wrong with it.

A GGUF file holds key-value metadata (architecture, shapes, tokenizer, chat template) and
the tensors, each of one type (float or a block-quantized format). gguf/reader.py parses the
layout (its reference, the `gguf` package's GGUFReader: gguf/reference.py); this module checks
that the file is whole and of a kind llmserve runs.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmserve.model.arch import UnsupportedModelError
from llmserve.model.gguf.dequant import BLOCKS, SUPPORTED_TYPES
from llmserve.model.gguf.reader import MAGIC, GGUFFormatError, map_file, read_header, tensor_data

# metadata arrays too large to keep as Python lists (the tokenizer reads them itself): stepped over
BULKY_KEYS = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                        "tokenizer.ggml.scores"})  # fmt: skip


class GGUFError(UnsupportedModelError):
    """A GGUF file llmserve cannot load; the message names the problem."""


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    type_name: str  # F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K
    shape: tuple[int, ...]  # row-major (PyTorch order: the last dimension is a row)
    data: np.ndarray  # the raw bytes (a view of the memory-mapped file)


@dataclass(frozen=True, slots=True)
class GGUFCheckpoint:
    path: Path
    metadata: dict[str, Any]  # every key but the tokenizer's vocabulary arrays
    vocab_size: int  # entries in tokenizer.ggml.tokens
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_key(self, key: str, default: Any = None) -> Any:
        """A key of the architecture's own namespace (`llama.block_count`, ...)."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


def is_gguf(path: str | os.PathLike) -> bool:
    """A regular file that starts with GGUF's magic bytes."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == MAGIC


def check_gguf_file(path: str | os.PathLike) -> None:
    """A file given as a model must be GGUF (the only single-file format llmserve reads)."""
    with Path(path).open("rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise GGUFError(f"{str(path)!r} is not a GGUF file (it starts with {head!r}, not {MAGIC!r}); "
                        "a model is a GGUF file or a Hugging Face folder (config.json, *.safetensors)")  # fmt: skip


def open_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Parse the file's metadata and tensor table (tensor data stays memory-mapped); the
    same unchanged file is parsed once per process (the config and the loader both read it)."""
    path = Path(path).resolve()
    check_gguf_file(path)
    stat = path.stat()
    return _parse(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _parse(path: Path, _mtime_ns: int, _size: int) -> GGUFCheckpoint:
    try:
        buf = map_file(path)
        header = read_header(buf, skip=BULKY_KEYS)
        data = [tensor_data(buf, header, t) for t in header.tensors]
    except GGUFFormatError as exc:
        raise GGUFError(f"{str(path)!r} is not a readable GGUF file (truncated or damaged: {exc})") from None
    if header.byte_order != "<":
        raise GGUFError(f"{str(path)!r} is a big-endian GGUF file; llmserve reads little-endian ones (llama.cpp's "
                        "gguf_convert_endian.py converts it)")  # fmt: skip
    tensors = {}
    for t, raw in zip(header.tensors, data, strict=True):
        if t.type_name not in BLOCKS:
            raise GGUFError(f"{str(path)!r}: tensor {t.name} is of type {t.type_name}, which llmserve does not "
                            f"read (supported: {', '.join(SUPPORTED_TYPES)})")  # fmt: skip
        tensors[t.name] = GGUFTensor(t.name, t.type_name, tuple(reversed(t.dims)), raw)
    metadata = {key: value for key, value in header.metadata.items() if key not in BULKY_KEYS}
    return GGUFCheckpoint(path, metadata, header.array_lengths.get("tokenizer.ggml.tokens", 0), tensors)
