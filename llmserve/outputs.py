"""What generation returns, shaped like vLLM's outputs so vLLM scripts run unchanged."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# one entry per generated token: token id -> its logprob (the sampled token and the top-k)
SampleLogprobs = Sequence[dict[int, Logprob]]
# one entry per prompt token, the first None (nothing comes before it): the prompt's token and the top-k
PromptLogprobs = Sequence[dict[int, Logprob] | None]


class LogprobStore:
    """A sample's logprobs as they arrive, in flat lists of numbers and (shared) strings.

    A dict of `Logprob`s a token is seven objects the garbage collector scans on every full
    collection while the request lives: 512 requests x 256 tokens with top-5 logprobs made a
    million, and the collections stalled the engine (docs/history/benchmarks.md). Here they are a few lists a sample; `FlatLogprobs` makes the dicts when read."""

    __slots__ = (
        "token_ids",
        "token_values",
        "token_ranks",
        "token_texts",
        "starts",
        "top_ids",
        "top_values",
        "top_texts",
    )

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.token_values: list[float] = []
        self.token_ranks: list[int] = []
        self.token_texts: list[str] = []
        self.starts: list[int] = [0]  # token i's top entries: top_*[starts[i]:starts[i + 1]]
        self.top_ids: list[int] = []
        self.top_values: list[float] = []
        self.top_texts: list[str] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    def add(
        self, token: int, logprob: float, rank: int, top: list[tuple[int, float]], text_of: Callable[[int], str]
    ) -> None:
        """Token `token` (its logprob and rank) and the top-k (id, logprob), best first."""
        self.token_ids.append(token)
        self.token_values.append(logprob)
        self.token_ranks.append(rank)
        self.token_texts.append(text_of(token))
        for tid, value in top:
            self.top_ids.append(tid)
            self.top_values.append(value)
            self.top_texts.append(text_of(tid))
        self.starts.append(len(self.top_ids))

    def entry(self, i: int) -> dict[int, Logprob]:
        """Token i's {token id: Logprob}: the top-k (ranks 1..k), then the sampled token with its rank."""
        first = self.starts[i]
        out = {
            self.top_ids[j]: Logprob(self.top_values[j], j - first + 1, self.top_texts[j])
            for j in range(first, self.starts[i + 1])
        }  # fmt: skip
        out[self.token_ids[i]] = Logprob(self.token_values[i], self.token_ranks[i], self.token_texts[i])
        return out

    def view(self) -> FlatLogprobs:
        return FlatLogprobs(self, len(self))


class FlatLogprobs(Sequence):
    """The first `length` tokens of a `LogprobStore`, read as a list of {token id: Logprob}
    dicts (made on each read). The store only grows, so a view stays as it was made."""

    __slots__ = ("_store", "_length")

    def __init__(self, store: LogprobStore, length: int) -> None:
        self._store, self._length = store, length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._store.entry(j) for j in range(*i.indices(self._length))]
        if i < 0:
            i += self._length
        if not 0 <= i < self._length:
            raise IndexError("logprobs index out of range")
        return self._store.entry(i)

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r})"


class FlatPromptLogprobs(FlatLogprobs):
    """A prompt's logprobs as vLLM gives them: None for its first token, then the store's
    entries (positions 1 .. `length`)."""

    __slots__ = ()

    def __len__(self) -> int:
        return self._length + 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if i == 0:
            return None
        return super().__getitem__(i - 1)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # `LLM.chat` with a reasoning parser: the thoughts and the answer after them (`text` stays whole)
    reasoning: str | None = None
    content: str | None = None

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
    prompt_logprobs: PromptLogprobs | None = field(default=None)  # when asked (SamplingParams.prompt_logprobs)
