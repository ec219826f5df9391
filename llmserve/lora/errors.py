"""The one error type of LoRA adapters: what went wrong, in words a client may read, and the
HTTP status a server answers with."""

from __future__ import annotations

from enum import StrEnum


class LoRAErrorKind(StrEnum):
    # no folder, not a folder, outside the allowed roots, unreadable, or without adapter_config.json and
    # adapter_model.safetensors: one message for all (UNUSABLE_PATH_MESSAGE), so a client cannot learn
    # which paths exist; the reason is in `detail`, for the server's log
    UNUSABLE_PATH = "unusable_path"
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


UNUSABLE_PATH_MESSAGE = ("lora_path does not name a LoRA adapter folder this server may load (a readable folder "
                         "with adapter_config.json and adapter_model.safetensors, inside --lora-roots when set)")  # fmt: skip


class LoRAAdapterError(ValueError):
    """An adapter that cannot be loaded or used. A ValueError, so the servers' error handlers
    already answer 400 with its message; `kind.status` gives the exact status. `detail`: the
    reason for the server's log (the message, but for an unusable path)."""

    def __init__(self, kind: LoRAErrorKind, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.detail = detail or message

    @property
    def status(self) -> int:
        return self.kind.status


def unusable_path(detail: str) -> LoRAAdapterError:
    return LoRAAdapterError(LoRAErrorKind.UNUSABLE_PATH, UNUSABLE_PATH_MESSAGE, detail)
