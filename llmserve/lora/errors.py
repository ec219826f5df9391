"""The one error type of LoRA adapters: what went wrong, in words a client may read, and the
HTTP status a server answers with."""

from __future__ import annotations

from enum import StrEnum


class LoRAErrorKind(StrEnum):
    MISSING_FILE = "missing_file"  # no folder, no adapter_config.json or no adapter_model.safetensors
    INVALID_CONFIG = "invalid_config"  # adapter_config.json is not JSON, or a field has a bad value
    INVALID_WEIGHTS = "invalid_weights"  # the safetensors file cannot be read, or A/B do not pair up
    RANK_TOO_LARGE = "rank_too_large"  # r above the server's maximum rank
    UNSUPPORTED_MODULE = "unsupported_module"  # a target other than q/k/v/o/gate/up/down_proj
    SHAPE_MISMATCH = "shape_mismatch"  # A/B do not fit the base model (another hidden size, more layers)
    UNSUPPORTED_FEATURE = "unsupported_feature"  # DoRA, biases, modules_to_save ...: refused, not ignored
    NOT_LOADED = "not_loaded"  # no adapter of that name in the slots
    NO_FREE_SLOT = "no_free_slot"  # every slot holds an adapter the running batch uses

    @property
    def status(self) -> int:
        if self is LoRAErrorKind.NOT_LOADED:
            return 404
        if self is LoRAErrorKind.NO_FREE_SLOT:
            return 503
        return 400


class LoRAAdapterError(ValueError):
    """An adapter that cannot be loaded or used. A ValueError, so the servers' error handlers
    already answer 400 with its message; `kind.status` gives the exact status."""

    def __init__(self, kind: LoRAErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message

    @property
    def status(self) -> int:
        return self.kind.status
