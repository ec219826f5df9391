"""`system_fingerprint`, as OpenAI sends it on every completion and chunk: names the backend's
configuration (llmserve's version, the model, its dtype and quantization, a LoRA adapter), so a
client can tell when answers to the same request may change. Stable for one server build and model."""

from __future__ import annotations

import functools
import hashlib

from llmserve import __version__
from llmserve.engine.protocol import EngineClient
from llmserve.lora_request import LoRARequest


@functools.lru_cache(maxsize=64)
def _fingerprint(key: str) -> str:
    return "fp_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def system_fingerprint(engine: EngineClient, lora_request: LoRARequest | None = None) -> str:
    mc = engine.model_config
    adapter = lora_request.key if lora_request is not None else ""
    return _fingerprint(f"llmserve {__version__}|{mc.model}|{mc.dtype}|{mc.quantization}|{adapter}")
