"""The Triton chat model's streamed responses, sent by one thread of their own.

Each `sender.send` is a round trip to Triton that waits with the GIL released (about 100 µs
here, scripts/triton_stream_costs.py), once per token of every stream. Made on the event loop
that runs the engine's outputs and builds the chunks, those waits were the loop's own time:
at a few thousand tokens a second the loop fell behind, and TTFT through the platform grew by
tens of milliseconds. Here the loop only queues a stream's events; this thread sends them,
and the events of one stream that waited together go as one response (`join_events`: the
gateway and other readers split them with `split_events`). So an idle platform sends each
token at once, and a busy one sends fewer, larger responses rather than falling behind.

The thread knows nothing of Triton: `respond(text)` makes a response, `final` is the flag
that ends a stream (tests give plain objects). `DirectSends` is the simple form beside it:
each event sent at once by the caller (the chat model's parameter `stream_sends: loop`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from llmserve.openai.sse_events import join_events

logger = logging.getLogger(__name__)


class StreamSends:
    """`respond(text)` makes a response; `fail(message)` an error response (it ends a stream whose
    send failed: the client sees an error, never a stream with events missing)."""

    def __init__(self, respond: Callable[[str], Any], final: int, fail: Callable[[str], Any] | None = None,
                 name: str = "llmserve-sends") -> None:  # fmt: skip
        self._respond = respond
        self._fail = fail
        self._final = final
        self._queue: deque[tuple[Any, str | None, bool]] = deque()
        self._ready = threading.Condition()
        self._closed = False
        self._broken: dict[int, Any] = {}  # streams whose send failed (held until their last item)
        self.sends = 0  # responses sent (each may carry several events)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, sender: Any, event: str | None, last: bool = False) -> None:
        """Queue `event` (a server-sent event; None: none) for `sender`'s stream; `last` ends it.
        After `close` the caller's thread sends it at once."""
        with self._ready:
            if not self._closed:
                self._queue.append((sender, event, last))
                if len(self._queue) == 1:  # the thread may be waiting (it is awake while the queue holds more)
                    self._ready.notify()
                return
        self._send(sender, [event] if event is not None else [], last)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then stop the thread."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join(timeout)

    def _take(self) -> list[tuple[Any, str | None, bool]] | None:
        with self._ready:
            while not self._queue and not self._closed:
                self._ready.wait()
            if not self._queue:
                return None
            taken = list(self._queue)
            self._queue.clear()
            return taken

    def _run(self) -> None:
        while (taken := self._take()) is not None:
            streams: dict[int, tuple[Any, list[str], list[bool]]] = {}  # in the order they came
            for sender, event, last in taken:
                _, events, ended = streams.setdefault(id(sender), (sender, [], [False]))
                if event is not None:
                    events.append(event)
                ended[0] = ended[0] or last
            for sender, events, ended in streams.values():
                self._send(sender, events, ended[0])

    def _send(self, sender: Any, events: list[str], last: bool) -> None:
        if id(sender) in self._broken:  # ended already, with an error
            if last:
                del self._broken[id(sender)]
            return
        flags = self._final if last else 0
        try:
            if events:
                sender.send(self._respond(join_events(events)), flags=flags)
            elif last:
                sender.send(flags=flags)
            else:
                return
            self.sends += 1
        except Exception as exc:  # noqa: BLE001 - one stream's failed send must not stop the others
            logger.warning("a streamed response could not be sent (%s: %s)", type(exc).__name__, exc)
            if not last:
                self._broken[id(sender)] = sender
            try:  # end the stream with the error, so that no client takes a gap for the whole answer
                if self._fail is not None:
                    sender.send(self._fail(f"{type(exc).__name__}: {exc}"), flags=self._final)
                else:
                    sender.send(flags=self._final)
            except Exception:  # noqa: BLE001 - the stream is gone (its client went away)
                pass


class DirectSends:
    """Each event sent at once, on the caller's thread, alone (StreamSends' reference)."""

    def __init__(self, respond: Callable[[str], Any], final: int) -> None:
        self._respond = respond
        self._final = final
        self.sends = 0

    def put(self, sender: Any, event: str | None, last: bool = False) -> None:
        flags = self._final if last else 0
        if event is not None:
            sender.send(self._respond(event.rstrip("\n")), flags=flags)
        elif last:
            sender.send(flags=flags)
        else:
            return
        self.sends += 1

    def close(self, timeout: float = 5.0) -> None:
        pass


def stream_sends(kind: str, respond: Callable[[str], Any], final: int,
                 fail: Callable[[str], Any] | None = None) -> StreamSends | DirectSends:  # fmt: skip
    """The chat model's parameter `stream_sends`: "thread" (the default) or "loop"."""
    if kind == "thread":
        return StreamSends(respond, final, fail)
    if kind == "loop":
        return DirectSends(respond, final)
    raise ValueError(f"stream_sends must be thread or loop, got {kind!r}")
