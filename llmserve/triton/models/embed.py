"""Triton Python-backend model: sentence embeddings (sentence-transformers), dynamically batched.

Input `text` (TYPE_STRING, [batch, 1]); output `embedding` (TYPE_FP32, [batch, dim]).
The model folder comes from the config parameter `model_dir` and is read offline.
"""

import server_path  # noqa: F401, I001 (first: PYTHONPATH into sys.path; see server_path.py)
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import triton_python_backend_utils as pb_utils


def _texts(tensor) -> list:
    """The request's texts; UnicodeDecodeError for bytes that are not UTF-8."""
    return [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in tensor.as_numpy().reshape(-1)]


def _invalid(message: str):
    """A response refusing one request (INVALID_ARG), leaving the others of the batch be."""
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None)  # error codes: python backend 23.08 and later
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(error=error)


class TritonPythonModel:
    def initialize(self, args):
        from sentence_transformers import SentenceTransformer

        params = json.loads(args["model_config"])["parameters"]
        self.model = SentenceTransformer(params["model_dir"]["string_value"], device="cpu")

    def execute(self, requests):
        # the dynamic batcher hands over several requests: encode the good ones as one batch;
        # a request that cannot be read gets its own error, the others their embeddings
        texts, counts, errors = [], [], {}
        for i, request in enumerate(requests):
            try:
                batch = _texts(pb_utils.get_input_tensor_by_name(request, "text"))
            except UnicodeDecodeError as exc:
                errors[i] = _invalid(f"text must be UTF-8: {exc}")
                batch = []
            texts.extend(batch)
            counts.append(len(batch))
        vectors = self.model.encode(texts, convert_to_numpy=True).astype(np.float32) if texts else None
        responses, start = [], 0
        for i, count in enumerate(counts):
            if i in errors:
                responses.append(errors[i])
                continue
            out = pb_utils.Tensor("embedding", vectors[start:start + count])
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
            start += count
        return responses
