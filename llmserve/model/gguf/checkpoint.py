"""Open a GGUF file (llama.cpp's single-file checkpoint) and say clearly what is wrong with it.

A GGUF file holds key-value metadata (architecture, shapes, tokenizer, chat template) and
the tensors, each of one type (float or a block-quantized format). The `gguf` package
parses the layout; this module checks that the file is whole and of a kind llmserve runs.
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

MAGIC = b"GGUF"
# metadata arrays too large to keep as Python lists (the tokenizer reads them itself)
_BULKY = frozenset({"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
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
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - the gguf package raises ValueError/KeyError/IndexError on damage
        raise GGUFError(f"{str(path)!r} is not a readable GGUF file (truncated or damaged: {exc})") from None
    metadata = {key: field.contents() for key, field in reader.fields.items() if key not in _BULKY}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    tensors = {}
    for t in reader.tensors:
        type_name = t.tensor_type.name
        if type_name not in BLOCKS:
            raise GGUFError(f"{str(path)!r}: tensor {t.name} is of type {type_name}, which llmserve does not "
                            f"read (supported: {', '.join(SUPPORTED_TYPES)})")  # fmt: skip
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        per_block, block_bytes = BLOCKS[type_name]
        if int(t.n_elements) % per_block or t.data.nbytes != int(t.n_elements) // per_block * block_bytes:
            raise GGUFError(f"{str(path)!r}: tensor {t.name} holds {t.data.nbytes} bytes, not what a {type_name} "
                            f"tensor of shape {shape} needs (the file is truncated or damaged)")  # fmt: skip
        tensors[t.name] = GGUFTensor(t.name, type_name, shape, t.data)
    return GGUFCheckpoint(path, metadata, len(tokens.data) if tokens is not None else 0, tensors)
