"""Triton Python-backend model: sentence embeddings (sentence-transformers), dynamically batched.

Input `text` (TYPE_STRING, [batch, 1]); output `embedding` (TYPE_FP32, [batch, dim]).
The model folder comes from the config parameter `model_dir` and is read offline.
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import triton_python_backend_utils as pb_utils


def _texts(tensor) -> list:
    return [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in tensor.as_numpy().reshape(-1)]


class TritonPythonModel:
    def initialize(self, args):
        from sentence_transformers import SentenceTransformer

        params = json.loads(args["model_config"])["parameters"]
        self.model = SentenceTransformer(params["model_dir"]["string_value"], device="cpu")

    def execute(self, requests):
        # the dynamic batcher hands over several requests: encode them as one batch
        texts, counts = [], []
        for request in requests:
            batch = _texts(pb_utils.get_input_tensor_by_name(request, "text"))
            texts.extend(batch)
            counts.append(len(batch))
        vectors = self.model.encode(texts, convert_to_numpy=True).astype(np.float32)
        responses, start = [], 0
        for count in counts:
            out = pb_utils.Tensor("embedding", vectors[start:start + count])
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
            start += count
        return responses
