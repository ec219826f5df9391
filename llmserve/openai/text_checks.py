"""Request text that no tokenizer can take: JSON may escape a lone UTF-16 surrogate
("\\ud800"), which parses into a Python string that has no UTF-8 form (tokenizers raise a
TypeError on it, Triton's strings are UTF-8). Such a request is a 400 in the server and in
the gateway, found from the raw body: only a body holding a surrogate escape is looked at
closely (an emoji escaped by an ASCII-only JSON writer is a valid pair and passes)."""

from __future__ import annotations

import json
import re
from typing import Any

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
LONE_SURROGATE = "the request holds a lone UTF-16 surrogate (such as \\ud800), which is not valid Unicode text"


def has_lone_surrogate(body: bytes, payload: Any = None) -> bool:
    """Whether the JSON `body` (parsed already: `payload`) holds a string with a lone surrogate."""
    if not _SURROGATE_ESCAPE.search(body):
        return False
    try:
        if payload is None:
            payload = json.loads(body)
        json.dumps(payload, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    except (ValueError, RecursionError):  # not JSON: the body's own parsing says so
        return False
    return False
