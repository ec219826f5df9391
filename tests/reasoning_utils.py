"""What a streaming client assembles from a chat answer's deltas, for the parser tests."""

from __future__ import annotations

from llmserve.openai.chat import MessageStream


def stream(parser, pieces: list[str], finish: str = "stop", tools=None):
    """Feed the cumulative text piece by piece; (reasoning, content, calls, finish) as assembled by a client."""
    ms = MessageStream(tools, parser)
    text, reasoning, content, calls, last = "", "", "", [], None
    for k, piece in enumerate(pieces):
        text += piece
        step = ms.step(text, finish if k == len(pieces) - 1 else None)
        if step is None:
            continue
        thought, delta, call_deltas, last = step
        reasoning += thought or ""
        content += delta or ""
        calls += call_deltas
    return reasoning or None, content or None, calls, last
