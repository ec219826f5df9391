"""llmserve: serve large language models fast.

The public names load on first use, so that light parts of the package (the gateway)
start without importing torch and the engine.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncEngine": "llmserve.engine.async_engine",
    "CompletionOutput": "llmserve.outputs",
    "EngineArgs": "llmserve.config",
    "LLM": "llmserve.llm",
    "LoRARequest": "llmserve.lora_request",
    "RequestOutput": "llmserve.outputs",
    "SamplingParams": "llmserve.sampling_params",
    "StructuredOutputsParams": "llmserve.sampling_params",
}

__all__ = [
    "LLM",
    "AsyncEngine",
    "LoRARequest",
    "CompletionOutput",
    "EngineArgs",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'llmserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
