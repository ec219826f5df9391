"""Several server-sent events in one text, and back: how the Triton chat model sends the events of
one stream that waited together, and how the gateway and other readers take them apart. No
imports, so the gateway (which must not import torch) can use it."""

from __future__ import annotations


def join_events(events: list[str]) -> str:
    """Several server-sent events as one text (as the Triton chat model sends the events of one
    stream that waited together): each event's `data:` line, separated by an empty line."""
    return "\n\n".join(event.rstrip("\n") for event in events)


def split_events(text: str) -> list[str]:
    """The events `join_events` joined (one event, or a body that is not an event, alone)."""
    return text.split("\n\n") if text.startswith("data: ") else [text]
