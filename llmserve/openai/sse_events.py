"""Several server-sent events in one text, and back: how the Triton chat model sends the events of
one stream that waited together, and how the gateway and other readers take them apart. No
imports, so the gateway (which must not import torch) can use it."""

from __future__ import annotations

# an SSE comment: what the Triton chat model writes to a call that has had nothing to send for a
# while and asked for keep-alives (so that Triton's HTTP server notices a client that left);
# readers skip it, and a keep-alive is never joined with events
KEEPALIVE = ": keep-alive"


def join_events(events: list[str]) -> str:
    """Several server-sent events as one text (as the Triton chat model sends the events of one
    stream that waited together): each event's `data:` line, separated by an empty line."""
    kept = [event for event in events if event != KEEPALIVE] or events[:1]  # a keep-alive goes alone
    return "\n\n".join(event.rstrip("\n") for event in kept)


def split_events(text: str) -> list[str]:
    """The events `join_events` joined (one event, or a body that is not an event, alone)."""
    return text.split("\n\n") if text.startswith("data: ") else [text]
