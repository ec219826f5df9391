"""What generation returns, shaped like vLLM's outputs so vLLM scripts run unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# one entry per generated token: token id -> its logprob (the sampled token and the top-k)
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times of one request: `arrival_time` on the front (the HTTP handler's
    entry when served), `sent_time` when the front sent it to the engine core,
    `queued_time` when the core process read it, `first_scheduled_time` its first step,
    `first_token_core_time` when the core finished the step with its first token,
    `first_token_time` when the front had that token."""

    arrival_time: float
    sent_time: float | None = None
    queued_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_core_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: None = field(default=None)
