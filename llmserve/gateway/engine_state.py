"""An upstream engine's state, read from the status sampler's scrapes of its metrics: `ok`,
`saturated` (requests have waited in its queue for a while) or `stuck` (requests run and no
token has been made for a while, or it stopped answering its metrics).

A replica whose health check passes may still serve nobody: Triton says a chat model is
ready while its engine is busy for clients that left, or hung. /health and the gateway's
metrics show these states, so that an operator (or an alert) sees them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

STATES = ("ok", "saturated", "stuck")


class Scrape(Protocol):
    t: float
    values: dict[str, float]  # empty: the scrape failed


@dataclass(frozen=True)
class EngineState:
    state: str  # ok | saturated | stuck
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    why: str | None = None  # for saturated and stuck

    def body(self) -> dict:
        body = {"state": self.state, "running": self.running, "waiting": self.waiting, "kv_usage": self.kv_usage}
        if self.why is not None:
            body["why"] = self.why
        return body


def _tokens(values: dict[str, float]) -> float:
    return values.get("prompt_tokens", 0.0) + values.get("generation_tokens", 0.0)


def engine_state(samples: Sequence[Scrape], stuck_after_s: float, saturated_after_s: float,
                 last_answer: Scrape | None = None) -> EngineState | None:  # fmt: skip
    """The state the latest scrapes say (None: the engine never answered with metrics);
    `last_answer`: the last scrape that answered, if older than `samples` keep."""
    answered = [s for s in samples if s.values]
    last_answer = answered[-1] if answered else last_answer
    if last_answer is None or not samples:
        return None
    latest = samples[-1]
    gauges = {k: last_answer.values.get(k) for k in ("running", "waiting", "kv_usage")}
    if not latest.values and latest.t - last_answer.t >= stuck_after_s:
        return EngineState("stuck", **gauges, why=f"its metrics have not answered for {latest.t - last_answer.t:.0f} s")
    # how long requests have run with no token made, and waited in the queue, up to the last answer
    idle_since = waiting_since = last_answer.t
    tokens = _tokens(last_answer.values)
    for sample in reversed(answered):
        if sample.values.get("running", 0) > 0 and _tokens(sample.values) == tokens:
            idle_since = sample.t
        else:
            break
    for sample in reversed(answered):
        if sample.values.get("waiting", 0) > 0:
            waiting_since = sample.t
        else:
            break
    if gauges["running"] and last_answer.t - idle_since >= stuck_after_s:
        return EngineState(
            "stuck", **gauges, why=f"requests running and no token made for {last_answer.t - idle_since:.0f} s"
        )
    if gauges["waiting"] and last_answer.t - waiting_since >= saturated_after_s:
        return EngineState("saturated", **gauges,
                           why=f"requests waiting in the engine's queue for {last_answer.t - waiting_since:.0f} s")  # fmt: skip
    return EngineState("ok", **gauges)
