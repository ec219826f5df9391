"""Errors shared across layers (a leaf: imports nothing of llmserve's, no torch). The engine raises
them; the OpenAI layer and the HTTP error handlers of the API server and the gateway answer them, and
the gateway must import nothing from `llmserve/engine/` (tests/test_layering.py)."""


class EngineDeadError(RuntimeError):
    """The engine core process is gone; no request can be served."""
