"""Errors the engine raises to its callers (light: importable without torch)."""


class EngineDeadError(RuntimeError):
    """The engine core process is gone; no request can be served."""
