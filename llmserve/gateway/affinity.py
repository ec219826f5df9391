"""Prefix affinity: requests whose prompts start alike go to the same replica, so its prefix cache hits.

The key is the start of what the model will read first: for chat, the leading system
message(s) (the part many users share), else the start of the conversation; for completions,
the start of the prompt; cut to `affinity_prefix_chars`. Replicas are chosen by rendezvous
hashing (the highest hash of key + replica wins), so a replica that goes away only moves the
keys it held.
"""

from __future__ import annotations

import hashlib
import json


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def prefix_key(payload: dict, chars: int) -> str:
    """What the request's prompt starts with, at most `chars` characters."""
    messages = payload.get("messages")
    if isinstance(messages, list):
        dicts = [m for m in messages if isinstance(m, dict)]
        system = []
        for m in dicts:
            if m.get("role") not in ("system", "developer"):
                break
            system.append(_text(m.get("content")))
        text = "\n".join(system) if system else "\n".join(f"{m.get('role')}:{_text(m.get('content'))}" for m in dicts)
    else:
        prompt = payload.get("prompt", "")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch: the first prompt decides
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)[:chars]
    return text[:chars]


def rendezvous_score(key: str, replica: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
