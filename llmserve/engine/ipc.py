"""The messages between the front (AsyncEngine) and the engine core process, typed.

Each message is a `Message`: a `Kind` and its payload. A call that expects an answer (a
utility, such as resetting the prefix cache) carries its own id, so concurrent calls of the
same utility each get their own answer.

    front → core: ADD (EngineCoreRequest) | ABORT ([request ids]) | UTILITY (UtilityCall) | SHUTDOWN
    core → front: READY (dict) | OUTPUTS (EngineCoreOutputs) | UTILITY_RESULT (UtilityResult)
                  | ERROR (traceback text)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class Kind(enum.Enum):
    ADD = "add"
    ABORT = "abort"
    UTILITY = "utility"
    SHUTDOWN = "shutdown"
    READY = "ready"
    OUTPUTS = "outputs"
    UTILITY_RESULT = "utility_result"
    ERROR = "error"


@dataclass(slots=True)
class Message:
    kind: Kind
    payload: Any = None


@dataclass(frozen=True, slots=True)
class UtilityCall:
    call_id: int
    name: str  # a method of EngineCore (core_process.UTILITIES)
    args: tuple = ()


@dataclass(frozen=True, slots=True)
class UtilityResult:
    call_id: int
    result: Any = None
    error: str | None = None  # the call raised: its message
