"""Triton Python-backend model: sentence embeddings (sentence-transformers), dynamically batched.

Inputs, one of the two a request: `text` (TYPE_STRING, [batch, 1]), or `token_ids` (TYPE_INT64,
[batch, n]: ids embedded exactly as given, no special tokens added; -1 pads a row that is
shorter than the longest). Outputs: `embedding` (TYPE_FP32, [batch, dim]) and `tokens`
(TYPE_INT32, [batch, 1]: the tokens each row is, special tokens included, as `llmserve serve
--task embed` counts them). The model folder comes from the config parameter `model_dir` and
is read offline.
"""

import server_path  # noqa: F401, I001 (first: PYTHONPATH into sys.path; see server_path.py)
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import triton_python_backend_utils as pb_utils

from llmserve.pooling import SentenceEncoder

PAD = -1  # what pads a shorter row of `token_ids`


def _texts(tensor) -> list:
    """The request's texts; UnicodeDecodeError for bytes that are not UTF-8."""
    return [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in tensor.as_numpy().reshape(-1)]


def _id_rows(tensor) -> list:
    """The request's token-id rows, their padding taken off."""
    rows = []
    for row in tensor.as_numpy().astype(np.int64).tolist():
        while row and row[-1] == PAD:
            row.pop()
        rows.append(row)
    return rows


def _invalid(message: str):
    """A response refusing one request (INVALID_ARG), leaving the others of the batch be."""
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None)  # error codes: python backend 23.08 and later
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(error=error)


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        # vectors as sentence-transformers' encode gives them (normalized if the model's modules say so)
        self.encoder = SentenceEncoder(params["model_dir"]["string_value"], device="cpu", batch_size=32,
                                       normalize=False)  # fmt: skip

    def _inputs(self, request) -> list:
        """The request's texts or token-id rows; ValueError says why it cannot be embedded."""
        text = pb_utils.get_input_tensor_by_name(request, "text")
        ids = pb_utils.get_input_tensor_by_name(request, "token_ids")
        if (text is None) == (ids is None):
            raise ValueError("a request takes either `text` or `token_ids`")
        if text is not None:
            try:
                return _texts(text)
            except UnicodeDecodeError as exc:
                raise ValueError(f"text must be UTF-8: {exc}") from None
        rows = _id_rows(ids)
        for row in rows:
            if (why := self.encoder.refuse_ids(row)) is not None:
                raise ValueError(why)
        return rows

    def execute(self, requests):
        # the dynamic batcher hands over several requests: encode the good ones as one batch;
        # a request that cannot be read gets its own error, the others their embeddings
        items, counts, errors = [], [], {}
        for i, request in enumerate(requests):
            try:
                batch = self._inputs(request)
            except ValueError as exc:
                errors[i] = _invalid(str(exc))
                batch = []
            items.extend(batch)
            counts.append(len(batch))
        vectors = self.encoder.embed(items) if items else None
        tokens = np.asarray(self.encoder.token_counts(items), dtype=np.int32).reshape(-1, 1)
        responses, start = [], 0
        for i, count in enumerate(counts):
            if i in errors:
                responses.append(errors[i])
                continue
            rows = slice(start, start + count)
            out = [pb_utils.Tensor("embedding", vectors[rows]), pb_utils.Tensor("tokens", tokens[rows])]
            responses.append(pb_utils.InferenceResponse(output_tensors=out))
            start += count
        return responses
