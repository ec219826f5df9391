"""The reference `open_gguf` is tested against: the `gguf` package's `GGUFReader`.

GGUFReader parses every element of every metadata array in Python (about 20 s of CPU for
Gemma 3's 262,144-token vocabulary), so llmserve reads the header itself (gguf/reader.py); this
builds the same `GGUFCheckpoint` from GGUFReader for the tests to compare (tests/test_gguf_reader.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from llmserve.model.gguf.checkpoint import BULKY_KEYS, GGUFCheckpoint, GGUFError, GGUFTensor, check_gguf_file
from llmserve.model.gguf.dequant import BLOCKS, SUPPORTED_TYPES


def gguf_package_reader(path: str | os.PathLike) -> Any:
    """The gguf package's GGUFReader on the file; GGUFError when it cannot parse it."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - the gguf package raises ValueError/KeyError/IndexError on damage
        raise GGUFError(f"{str(path)!r} is not a readable GGUF file (truncated or damaged: {exc})") from None


def open_gguf_reference(path: str | os.PathLike, reader: Any = None) -> GGUFCheckpoint:
    """`open_gguf` through the gguf package (`reader`: its GGUFReader on the file, when already made)."""
    path = Path(path).resolve()
    check_gguf_file(path)
    reader = gguf_package_reader(path) if reader is None else reader
    metadata = {key: field.contents() for key, field in reader.fields.items() if key not in BULKY_KEYS}
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
