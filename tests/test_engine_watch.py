"""The parts that keep a departed client from holding an engine, and that show a busy or stuck
one, without a server: the Triton chat model's in-flight watcher (plain objects for Triton's
requests), keep-alives in a stream's sends, the engine state read from metric scrapes, the
merged metrics pages, and the gateway's cap on a request's deadline."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import pytest

from llmserve.gateway.dashboard import Sample
from llmserve.gateway.engine_state import engine_state
from llmserve.gateway.metrics_pages import merged_pages
from llmserve.openai.sse_events import KEEPALIVE, join_events, split_events
from llmserve.triton.inflight import InFlightWatch
from llmserve.triton.stream_sends import StreamSends

pytestmark = pytest.mark.unit


@dataclass
class FakeRequest:
    cancelled: bool = False
    asked: int = 0

    def is_cancelled(self) -> bool:
        self.asked += 1
        return self.cancelled


@dataclass
class Sends:
    sent: list[str] = field(default_factory=list)

    def keepalive(self) -> None:
        self.sent.append(KEEPALIVE)


def test_the_watcher_cancels_a_quiet_request_whose_client_left():
    async def run():
        watch = InFlightWatch(poll_s=0.01)
        request = FakeRequest()
        task = asyncio.ensure_future(asyncio.sleep(60))  # a whole answer being made
        entry = watch.add(request, task, 0.0, lambda: None)
        watcher = asyncio.ensure_future(watch.run())
        await asyncio.sleep(0.05)
        assert not task.done() and request.asked >= 2  # asked about while quiet
        request.cancelled = True
        await asyncio.sleep(0.05)
        assert task.cancelled() and entry.cancelled and entry not in watch.requests
        watcher.cancel()

    asyncio.run(run())


def test_keepalives_go_to_quiet_calls_only_and_asks_are_rationed():
    watch = InFlightWatch(poll_s=0.05)
    quiet, busy = Sends(), Sends()
    loop = asyncio.new_event_loop()
    task = loop.create_future()
    a = watch.add(FakeRequest(), task, 0.5, quiet.keepalive)
    b = watch.add(FakeRequest(), task, 0.5, busy.keepalive)
    t0 = a.last_sent
    for i in range(1, 21):  # two seconds of ticks; `b` sends a token every 0.1 s
        now = t0 + i * 0.1
        b.sent(now)
        watch.tick(now)
    assert len(quiet.sent) == 4 and busy.sent == [] and watch.keepalives == 4
    assert a.request.asked == 20  # once a tick: never more often than poll_s
    no_keepalives = Sends()
    watch.add(FakeRequest(), task, 0.0, no_keepalives.keepalive)
    watch.tick(t0 + 10)
    assert no_keepalives.sent == []
    loop.close()


def test_a_stream_that_finds_its_client_gone_is_left_to_end_itself():
    watch = InFlightWatch(poll_s=0.0)
    loop = asyncio.new_event_loop()
    task = loop.create_future()
    request = FakeRequest(cancelled=True)
    entry = watch.add(request, task, 0.0, lambda: None)
    assert watch.due(entry, entry.last_asked + 1)  # the stream asks as it sends, and breaks out itself
    watch.tick(entry.last_asked + 2)
    assert not task.cancelled()  # the watcher does not cancel a stream ending itself
    loop.close()


def test_a_keepalive_is_never_joined_with_events():
    assert join_events([KEEPALIVE]) == KEEPALIVE
    events = ['data: {"a": 1}', KEEPALIVE, 'data: {"b": 2}']
    assert split_events(join_events(events)) == ['data: {"a": 1}', 'data: {"b": 2}']


def test_stream_sends_send_a_keepalive_alone_and_drop_it_beside_events():
    import threading

    sent: list[tuple[str | None, int]] = []
    done = threading.Event()

    class Sender:
        def send(self, response=None, flags=0):
            sent.append((response, flags))
            if flags:
                done.set()

    sends = StreamSends(lambda text: text, final=1)
    sender = Sender()
    sends.put(sender, KEEPALIVE)
    sends.put(sender, "data: {}", last=False)
    sends.put(sender, None, last=True)
    assert done.wait(5)
    sends.close()
    texts = [r for r, _ in sent if r is not None]
    assert all(KEEPALIVE not in t or t == KEEPALIVE for t in texts) and "data: {}" in "".join(texts)


def _samples(rows: list[tuple[float, dict]]) -> list[Sample]:
    return [Sample(t, values) for t, values in rows]


def test_engine_state_ok_saturated_stuck():
    busy = {"running": 2.0, "waiting": 0.0, "kv_usage": 0.3}
    moving = _samples([(t, {**busy, "generation_tokens": 10.0 * t}) for t in range(40)])
    assert engine_state(moving, 30, 5).state == "ok"
    frozen = _samples([(t, {**busy, "generation_tokens": 100.0}) for t in range(40)])
    state = engine_state(frozen, 30, 5)
    assert state.state == "stuck" and "no token made for 39 s" in state.why
    assert engine_state(frozen[-20:], 30, 5).state == "ok"  # 19 s: not yet
    queued = _samples([(t, {**busy, "waiting": 3.0, "generation_tokens": 10.0 * t}) for t in range(10)])
    assert engine_state(queued, 30, 5).state == "saturated"
    assert engine_state(queued[-3:], 30, 5).state == "ok"
    idle = _samples([(t, {"running": 0.0, "waiting": 0.0, "generation_tokens": 5.0}) for t in range(60)])
    assert engine_state(idle, 30, 5).state == "ok"  # nothing to do is not stuck


def test_an_engine_that_stops_answering_is_stuck_and_one_never_heard_from_has_no_state():
    answered = Sample(0.0, {"running": 1.0, "generation_tokens": 1.0})
    silent = _samples([(t, {}) for t in range(1, 45)])
    state = engine_state(silent, 30, 5, last_answer=answered)
    assert state.state == "stuck" and "not answered for 44 s" in state.why
    assert engine_state(silent[:10], 30, 5, last_answer=answered).state == "ok"
    assert engine_state(silent, 30, 5) is None


PAGE = """# HELP vllm:num_requests_running Requests in the running batch.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="{name}"}} {value}
# HELP vllm:generation_tokens_total Generated tokens.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{model_name="{name}"}} 7.0
"""


def test_merged_pages_write_each_family_once():
    text = merged_pages([PAGE.format(name="a", value=1.0), PAGE.format(name="b", value=2.0), "# broken {"]).decode()
    assert text.count("# TYPE vllm:num_requests_running gauge") == 1
    assert 'vllm:num_requests_running{model_name="a"} 1.0' in text
    assert 'vllm:num_requests_running{model_name="b"} 2.0' in text
    assert text.count("vllm:generation_tokens_total{") == 2
    assert merged_pages([]) == b""


def test_the_gateway_caps_a_chat_request_deadline_and_leaves_bad_values_to_the_model():
    from llmserve.gateway.context import RequestContext
    from llmserve.gateway.triton_upstream import _chat_request

    class Route:
        lora = None
        send_priority = False

    class Pick:
        route = Route()

    def sent(payload: dict, cap: float | None) -> object:
        ctx = RequestContext("id", "/v1/completions", "chat", payload, stream=False, key=None)
        return json.loads(_chat_request(ctx, Pick(), cap)[0]).get("request_timeout_s")

    assert sent({}, 600.0) == 600.0
    assert sent({"request_timeout_s": 5}, 600.0) == 5
    assert sent({"request_timeout_s": 5000}, 600.0) == 600.0
    assert sent({"request_timeout_s": "soon"}, 600.0) == "soon"  # the model answers 400
    assert sent({}, None) is None
