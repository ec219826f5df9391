"""The Triton chat model's sending thread (llmserve/triton/stream_sends.py), with plain senders:
idle, each event goes alone; busy, a stream's waiting events go as one response, in order,
with the final flag; a failing stream leaves the others be."""

from __future__ import annotations

import threading
import time

import pytest

from llmserve.openai.sse_events import join_events, split_events
from llmserve.triton.stream_sends import DirectSends, StreamSends, stream_sends

pytestmark = pytest.mark.unit

FINAL = 1


class Sender:
    """Records (name, text, flags) of each send; the first send waits for `gate` when given."""

    def __init__(self, name: str, log: list, gate: threading.Event | None = None, fail: bool = False) -> None:
        self.name, self.log, self.gate, self.fail = name, log, gate, fail

    def send(self, response=None, flags: int = 0) -> None:
        if self.gate is not None:
            self.gate.wait(10)
            self.gate = None
        if self.fail:
            raise RuntimeError("the client went away")
        self.log.append((self.name, response, flags))


def _wait_for(log: list, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(log) < n:
        assert time.monotonic() < deadline, log
        time.sleep(0.001)


def test_events_join_and_split_back():
    events = ['data: {"a": 1}\n\n', 'data: {"b": "x\\ny"}\n\n', "data: [DONE]\n\n"]
    assert split_events(join_events(events)) == [e.rstrip("\n") for e in events]
    assert split_events('{"whole": "body"}') == ['{"whole": "body"}']


def test_an_idle_thread_sends_each_event_alone():
    log: list = []
    sends = StreamSends(lambda text: text, FINAL)
    a = Sender("a", log)
    for i, event in enumerate(["data: 1", "data: 2", "data: [DONE]"]):
        sends.put(a, event)
        _wait_for(log, i + 1)
    sends.put(a, None, last=True)
    _wait_for(log, 4)
    sends.close()
    assert log == [("a", "data: 1", 0), ("a", "data: 2", 0), ("a", "data: [DONE]", 0), ("a", None, FINAL)]
    assert sends.sends == 4


def test_a_busy_thread_sends_each_streams_waiting_events_together():
    log: list = []
    gate = threading.Event()
    sends = StreamSends(lambda text: text, FINAL)
    a, b = Sender("a", log, gate), Sender("b", log)
    sends.put(a, "data: a0")  # taken at once; its send waits for the gate while the rest queue
    time.sleep(0.05)
    for event in ("data: a1", "data: a2", "data: [DONE]"):
        sends.put(a, event)
    sends.put(b, "data: b0")
    sends.put(a, None, last=True)
    sends.put(b, "data: b1")
    gate.set()
    _wait_for(log, 3)
    sends.close()
    assert log == [("a", "data: a0", 0), ("a", "data: a1\n\ndata: a2\n\ndata: [DONE]", FINAL),
                   ("b", "data: b0\n\ndata: b1", 0)]  # fmt: skip
    assert split_events(log[1][1]) == ["data: a1", "data: a2", "data: [DONE]"]


def test_a_failing_stream_leaves_the_others_and_close_sends_what_waits():
    log: list = []
    gate = threading.Event()
    sends = StreamSends(lambda text: text, FINAL)
    first, broken, ok = Sender("first", log, gate), Sender("broken", log, fail=True), Sender("ok", log)
    sends.put(first, "data: 0")
    time.sleep(0.05)
    sends.put(broken, "data: x", last=True)
    sends.put(ok, "data: y", last=True)
    gate.set()
    sends.close()  # waits for the queue to empty
    assert log == [("first", "data: 0", 0), ("ok", "data: y", FINAL)]
    assert sends.sends == 2


def test_direct_sends_each_event_at_once_and_the_choice_is_checked():
    log: list = []
    sends = stream_sends("loop", lambda text: text, FINAL)
    assert isinstance(sends, DirectSends)
    a = Sender("a", log)
    sends.put(a, "data: 1\n\n")
    sends.put(a, "data: [DONE]\n\n", last=True)
    sends.put(a, None)  # nothing to send
    assert log == [("a", "data: 1", 0), ("a", "data: [DONE]", FINAL)] and sends.sends == 2
    assert isinstance(stream_sends("thread", lambda text: text, FINAL), StreamSends)
    import pytest

    with pytest.raises(ValueError, match="thread or loop"):
        stream_sends("both", lambda text: text, FINAL)


class FailsOnce(Sender):
    """Its first send (of anything) raises; later sends are recorded."""

    def send(self, response=None, flags: int = 0) -> None:
        if not getattr(self, "failed", False):
            self.failed = True
            raise RuntimeError("could not encode")
        super().send(response, flags)


def test_a_failed_send_ends_its_stream_with_an_error_and_nothing_after():
    log: list = []
    gate = threading.Event()
    sends = StreamSends(lambda text: text, FINAL, fail=lambda message: f"error: {message}")
    first, broken = Sender("first", log, gate), FailsOnce("broken", log)
    sends.put(first, "data: 0")
    time.sleep(0.05)
    sends.put(broken, "data: 1")  # fails: the stream ends here with the error
    gate.set()
    _wait_for(log, 2)
    sends.put(broken, "data: 2")  # dropped: the client saw the stream end
    sends.put(broken, "data: [DONE]", last=True)
    later = FailsOnce("later", log)
    sends.put(later, "data: x", last=True)  # its last send fails: the error ends it instead
    sends.close()
    assert log == [("first", "data: 0", 0), ("broken", "error: RuntimeError: could not encode", FINAL),
                   ("later", "error: RuntimeError: could not encode", FINAL)]  # fmt: skip
    assert not sends._broken  # the broken stream's entry went with its last item


def test_after_close_the_caller_sends():
    log: list = []
    sends = StreamSends(lambda text: text, FINAL)
    sends.close()
    a = Sender("a", log)
    sends.put(a, "data: late")
    sends.put(a, None, last=True)
    assert log == [("a", "data: late", 0), ("a", None, FINAL)]
