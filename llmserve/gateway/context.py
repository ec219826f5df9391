"""What one request carries through the gateway, and its line in the access log."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from llmserve.gateway.admission import Slot
from llmserve.gateway.config import ApiKey
from llmserve.gateway.kv_prompt import KVPrompt

access_log = logging.getLogger("llmserve.gateway.access")


@dataclass
class RequestContext:
    request_id: str
    path: str  # e.g. /v1/chat/completions
    alias: str  # the model the client asked for
    payload: dict
    stream: bool
    key: ApiKey | None
    reserved_tokens: int = 0
    used_tokens: int = 0
    usage: dict | None = None  # the answer's usage, where it carried one (counted by kind in the metrics)
    served_by: str | None = None  # the alias whose replica answered
    slot: Slot | None = None  # the admission slot held until the response is over
    prefix: str | None = None  # what the prompt starts with, for prefix-affinity routing
    kv_prompt: KVPrompt | None = None  # the prompt's token ids, for kv_aware routing
    placed: bool = False  # counted in flight by the placement (released in `finish`)
    started: float = field(default_factory=time.monotonic)

    def saw_usage(self, usage: dict) -> None:
        """The answer's usage: the limits settle with its total (the thoughts are in it: a
        reasoning model's reasoning tokens are completion tokens)."""
        self.usage = usage
        total = usage.get("total_tokens")
        if isinstance(total, int):
            self.used_tokens = total

    @property
    def priority(self) -> int:
        return self.key.priority if self.key is not None else 0


def log_access(request_id: str, status: int, **fields) -> None:
    """One JSON line a request, so logs can be searched by request id."""
    access_log.info(json.dumps({"request_id": request_id, "status": status, **fields}))
