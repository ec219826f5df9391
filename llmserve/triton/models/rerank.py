"""Triton Python-backend model: score documents against a query.

Inputs `query` (TYPE_STRING, [batch, 1]) and `documents` (TYPE_STRING, [batch, n]);
outputs `scores` (TYPE_FP32, [batch, n]) and `tokens` (TYPE_INT32, [batch, 1]: the tokens the
row was, special tokens included). By default a bi-encoder: cosine similarity of sentence
embeddings (`model_dir`; tokens: the query's and each document's, as `llmserve serve --task
embed` counts them); with `cross_encoder_dir` set, a cross-encoder's scores (tokens: each
(query, document) pair's).
"""

import server_path  # noqa: F401, I001 (first: PYTHONPATH into sys.path; see server_path.py)
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import triton_python_backend_utils as pb_utils

from llmserve.pooling import SentenceEncoder, cosine_scores


def _texts(array) -> list:
    return [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in array.reshape(-1)]


def _invalid(message: str):
    """A response refusing one request (INVALID_ARG)."""
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None)  # error codes: python backend 23.08 and later
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(error=error)


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        cross = params.get("cross_encoder_dir", {}).get("string_value", "")
        if cross:
            from sentence_transformers import CrossEncoder

            self.cross = CrossEncoder(cross, device="cpu")
            self.encoder = None
        else:
            self.cross = None
            self.encoder = SentenceEncoder(params["model_dir"]["string_value"], device="cpu")

    def _scores(self, query: str, docs: list) -> tuple[np.ndarray, int]:
        """The documents' scores, and the tokens the model read for them."""
        if self.cross is not None:
            pairs = self.cross.tokenizer([query] * len(docs), docs, truncation=False, verbose=False)["input_ids"]
            scores = self.cross.predict([(query, d) for d in docs])
            return np.asarray(scores, dtype=np.float32), sum(len(p) for p in pairs)
        vecs = self.encoder.embed([query] + docs)  # L2-normalized
        return cosine_scores(vecs[0], vecs[1:]), sum(self.encoder.token_counts([query] + docs))

    def execute(self, requests):
        responses = []
        for request in requests:  # each request answered on its own: a bad one fails alone
            queries = pb_utils.get_input_tensor_by_name(request, "query").as_numpy()
            documents = pb_utils.get_input_tensor_by_name(request, "documents").as_numpy()
            try:
                pairs = [(_texts(q)[0], _texts(d)) for q, d in zip(queries, documents)]
            except UnicodeDecodeError as exc:
                responses.append(_invalid(f"query and documents must be UTF-8: {exc}"))
                continue
            rows = [self._scores(q, d) for q, d in pairs]
            scores = np.stack([r[0] for r in rows]).astype(np.float32)
            tokens = np.array([[r[1]] for r in rows], dtype=np.int32)
            out = [pb_utils.Tensor("scores", scores), pb_utils.Tensor("tokens", tokens)]
            responses.append(pb_utils.InferenceResponse(output_tensors=out))
        return responses
