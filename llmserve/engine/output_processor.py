"""Front-side output handling: detokenize, apply stop strings, gather n samples.

Turns the core's per-step token deltas into `RequestOutput`s (cumulative text and
tokens, as vLLM returns them). A stop string found here ends the sample and the core
request is aborted, so its blocks are freed at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.engine.input_processor import ProcessedRequest
from llmserve.engine.request import EngineCoreOutput
from llmserve.outputs import CompletionOutput, FlatPromptLogprobs, LogprobStore, RequestMetrics, RequestOutput


class RequestFailedError(RuntimeError):
    """The engine core refused or lost a request."""


@dataclass(slots=True)
class FinishedRequestStats:
    """As vLLM splits it: queue and prefill time are the core's view, end to end and
    decode time the front's."""

    request_id: str
    finish_reason: str
    e2e_latency: float  # arrival -> finished
    queue_time: float  # queued in the core -> first scheduled
    prefill_time: float  # first scheduled -> the core's step with the first token
    decode_time: float  # first token -> finished
    num_prompt_tokens: int
    num_generation_tokens: int
    timeline: RequestMetrics  # every wall-clock time (the request timing log writes them)


@dataclass(slots=True)
class IterationStats:
    """What one batch of core outputs did, for request-level metrics."""

    num_prompt_tokens: int = 0  # prompts that got their first token now
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


@dataclass(slots=True)
class _Sample:
    index: int
    core_id: str
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: LogprobStore | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    last_token_time: float | None = None
    # tokens that end the output without their text in it (EOS, stop_token_ids; none with
    # include_stop_str_in_output), as vLLM: shown only with skip_special_tokens false
    silent_stops: frozenset[int] = frozenset()
    # the last tokens of token_ids not yet given to the detokenizer (`process(only_finished=True)`
    # defers them while nothing reads the text and nothing can end the sample; `_catch_up`)
    undecoded: int = 0


@dataclass(slots=True)
class _RequestState:
    processed: ProcessedRequest
    samples: list[_Sample]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: LogprobStore | None = None  # when asked: positions 1.. of the prompt

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


@dataclass(slots=True)
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    core_ids_to_abort: list[str]
    errors: dict[str, str]  # request id -> why the core refused it
    stats: IterationStats


def _silent_stops(params, eos_token_ids) -> frozenset[int]:
    """The tokens whose text a request's output leaves out when they end it."""
    if params.include_stop_str_in_output:
        return frozenset()
    return frozenset(params.stop_token_ids or ()) | frozenset(() if params.ignore_eos else eos_token_ids)


class OutputProcessor:
    # `process(only_finished=True)` detokenizes a sample's tokens when its text is read (the sample
    # ends, or a step's output needs the slow path), not each step: the same tokens through the same
    # detokenizer, one call instead of one a step. False: each step's (the reference a test compares)
    defer_detok = True

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}
        self.core_to_request: dict[str, tuple[str, int]] = {}
        # each token id's text on its own, as logprobs show it: decoded once (a decode call was 9 µs,
        # six a token with top-5 logprobs: 512 rows took longer than a decode step of the 8B model)
        self._token_text: dict[int, str] = {}

    def add_request(self, processed: ProcessedRequest) -> None:
        params = processed.params
        samples = []
        for i, core_req in enumerate(processed.core_requests):
            detok = IncrementalDetokenizer(
                self.tokenizer,
                processed.prompt_token_ids,
                params.skip_special_tokens,
                params.stop_strings,
                params.include_stop_str_in_output,
            )
            sample = _Sample(i, core_req.request_id, detok, silent_stops=_silent_stops(params, core_req.eos_token_ids))
            if params.logprobs is not None:
                sample.logprobs, sample.cumulative_logprob = LogprobStore(), 0.0
            samples.append(sample)
            self.core_to_request[core_req.request_id] = (processed.request_id, i)
        arrival = processed.core_requests[0].arrival_time
        state = _RequestState(processed, samples, RequestMetrics(arrival))
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = LogprobStore()
        self.states[processed.request_id] = state

    def mark_sent(self, request_id: str, when: float) -> None:
        """The front sent the request to the core at `when` (wall clock)."""
        if (state := self.states.get(request_id)) is not None:
            state.metrics.sent_time = when

    def has_unfinished(self) -> bool:
        return bool(self.states)

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns its unfinished core ids to abort in the core."""
        state = self.states.pop(request_id, None)
        if state is None:
            return []
        for s in state.samples:
            self.core_to_request.pop(s.core_id, None)
        return [s.core_id for s in state.samples if s.finish_reason is None]

    def process(
        self, outputs: list[EngineCoreOutput], only_finished: bool = False, core_time: float | None = None
    ) -> ProcessedOutputs:
        """`only_finished`: build RequestOutputs just for finished requests (offline use,
        where nobody reads the partial ones). `core_time`: when the core finished the step
        that made these outputs (default: now)."""
        now = time.time()
        core_time = now if core_time is None else core_time
        touched: dict[str, _RequestState] = {}
        ended: set[str] = set()  # requests a sample of which finished here
        to_abort: list[str] = []
        errors: dict[str, str] = {}
        stats = IterationStats()
        lookup, states, latencies = self.core_to_request.get, self.states, stats.inter_token_latencies
        defer = only_finished and self.defer_detok
        generated = 0
        for out in outputs:  # (every request, every step: kept lean)
            key = lookup(out.request_id)
            if key is None:
                continue  # already finished here (stop string) or aborted
            request_id, index = key
            state = states[request_id]
            if out.error is not None:
                errors[request_id] = out.error
                to_abort.extend(self.abort(request_id))
                continue
            sample = state.samples[index]
            if out.new_prompt_logprobs and state.prompt_logprobs is not None:
                self._add_prompt_logprobs(state, out.new_prompt_logprobs)
            if sample.finish_reason is None:
                detok = sample.detok
                if out.finish_reason is None and not out.new_logprobs and not detok.stop_strings:
                    sample.token_ids += out.new_token_ids  # (`_update_sample` where nothing can end it)
                    if defer:  # nobody reads the text before the sample ends: decoded then (`_catch_up`)
                        sample.undecoded += len(out.new_token_ids)
                    else:
                        detok.add_tokens(out.new_token_ids)
                else:
                    self._update_sample(sample, out, to_abort)
                    if sample.finish_reason is not None:
                        ended.add(request_id)
            m = state.metrics
            if m.first_token_time is None or m.first_scheduled_time is None:
                self._record_first(state, out, now, core_time, stats)
            elif out.num_cached_tokens > state.num_cached_tokens:
                state.num_cached_tokens = out.num_cached_tokens
            if sample.last_token_time is not None:
                latencies.append(now - sample.last_token_time)
            sample.last_token_time = m.last_token_time = now
            generated += len(out.new_token_ids)
            touched[request_id] = state
        stats.num_generation_tokens += generated
        results = []
        if ended or not only_finished:  # (a state is finished only in the call its last sample finishes)
            for request_id, state in touched.items():
                if request_id in ended and state.finished:
                    state.metrics.finished_time = now
                    self.abort(request_id)
                    stats.finished.append(self._finished_stats(state))
                elif only_finished:
                    continue
                results.append(self._request_output(state))
        return ProcessedOutputs(results, to_abort, errors, stats)

    @staticmethod
    def _record_first(
        state: _RequestState, out: EngineCoreOutput, now: float, core_time: float, stats: IterationStats
    ) -> None:
        """`_record_timing`'s first-token part (the rest is in `process`'s loop)."""
        m = state.metrics
        state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
        if m.first_scheduled_time is None:
            m.first_scheduled_time, m.queued_time = out.first_scheduled_time, out.queued_time
        if m.first_token_time is None:
            m.first_token_time, m.first_token_core_time = now, core_time
            stats.time_to_first_tokens.append(now - m.arrival_time)
            stats.num_prompt_tokens += len(state.processed.prompt_token_ids)

    @staticmethod
    def _finished_stats(state: _RequestState) -> FinishedRequestStats:
        m = state.metrics
        reasons = {s.finish_reason for s in state.samples}
        # clamped so that each phase is >= 0 whatever the clocks did (and for requests that
        # finished without a token); the core's times fall back to the front's
        queued = max(m.arrival_time, m.queued_time or m.arrival_time)
        scheduled = max(queued, m.first_scheduled_time or queued)
        first_token = min(m.finished_time, max(m.arrival_time, m.first_token_time or m.finished_time))
        core_first_token = max(scheduled, m.first_token_core_time or first_token)
        return FinishedRequestStats(
            request_id=state.processed.request_id,
            finish_reason="stop" if reasons == {"stop"} else next(iter(reasons - {"stop"})),
            e2e_latency=m.finished_time - m.arrival_time,
            queue_time=scheduled - queued,
            prefill_time=core_first_token - scheduled,
            decode_time=m.finished_time - first_token,
            num_prompt_tokens=len(state.processed.prompt_token_ids),
            num_generation_tokens=sum(len(s.token_ids) for s in state.samples),
            timeline=m,
        )

    @staticmethod
    def _catch_up(sample: _Sample) -> None:
        """Give the detokenizer the sample's deferred tokens (`defer_detok`): one call over the
        tokens a step each would have given it, with no stop string to find among them."""
        if sample.undecoded:
            sample.detok.add_tokens(sample.token_ids[len(sample.token_ids) - sample.undecoded :])
            sample.undecoded = 0

    def _update_sample(self, sample: _Sample, out: EngineCoreOutput, to_abort: list[str]) -> None:
        if sample.finish_reason is not None:
            return
        self._catch_up(sample)
        sample.token_ids.extend(out.new_token_ids)
        if out.new_logprobs and sample.logprobs is not None:
            for token, lp in zip(out.new_token_ids, out.new_logprobs):
                sample.logprobs.add(token, lp.token_logprob, lp.token_rank, lp.top, self._text_of)
                sample.cumulative_logprob += lp.token_logprob
        new = out.new_token_ids
        if out.finish_reason == "stop" and new and new[-1] in sample.silent_stops:
            new = new[:-1]  # the stop token itself is not text (its id stays in token_ids)
        stop = sample.detok.add_tokens(new)
        if stop is not None:
            sample.finish_reason, sample.stop_reason = "stop", stop
            if out.finish_reason is None:
                to_abort.append(sample.core_id)
        elif out.finish_reason is not None:
            sample.detok.flush()  # a last character left unfinished shows as a decode shows it
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason

    def _add_prompt_logprobs(self, state: _RequestState, entries: list) -> None:
        """Prompt positions from the next one on, each the prompt's token there and the top-k."""
        store, prompt = state.prompt_logprobs, state.processed.prompt_token_ids
        for lp in entries:
            store.add(prompt[len(store) + 1], lp.token_logprob, lp.token_rank, lp.top, self._text_of)

    def _text_of(self, token: int) -> str:
        """`tokenizer.decode([token])`, from the cache after the first time."""
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token])
        return text

    def _request_output(self, state: _RequestState) -> RequestOutput:
        p = state.processed
        for s in state.samples:
            self._catch_up(s)
        outputs = [
            CompletionOutput(
                index=s.index,
                text=s.detok.visible_text(s.finish_reason is not None),
                token_ids=list(s.token_ids),
                cumulative_logprob=s.cumulative_logprob,
                logprobs=s.logprobs.view() if s.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for s in state.samples
        ]
        return RequestOutput(
            request_id=p.request_id,
            prompt=p.prompt,
            prompt_token_ids=p.prompt_token_ids,
            outputs=outputs,
            finished=state.finished,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
            prompt_logprobs=None if state.prompt_logprobs is None
            else FlatPromptLogprobs(state.prompt_logprobs, len(state.prompt_logprobs)),
        )  # fmt: skip
