"""Structured outputs' grammars compiled off the step loop, one request at a time.

A request with a grammar spec enters the scheduler at once, in the WAITING_FOR_GRAMMAR
state, which the scheduler passes over (it keeps its place by priority and arrival, and
an abort finds it where every other request is). Compiles run on a small thread pool
(xgrammar works mostly outside the GIL; a big schema takes long); `poll` hands each
finished compile to its request (its matcher, and the state WAITING, so the next
schedule admits it) and reports the requests whose spec failed, which the core then
finishes with the error.
"""

from __future__ import annotations

import os
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from llmserve.engine.request import Request, RequestStatus
from llmserve.engine.structured_output import StructuredOutputError, StructuredOutputs


@dataclass(frozen=True, slots=True)
class GrammarFailure:
    request_id: str
    error: str  # why the spec does not compile


class GrammarManager:
    def __init__(self, structured: StructuredOutputs) -> None:
        self.structured = structured
        self._compiling: dict[str, tuple[Request, Future]] = {}
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, request: Request) -> None:
        """Start compiling `request`'s spec; the request waits for it."""
        spec = request.sampling_params.structured_outputs
        assert spec is not None, "only requests with a grammar spec wait for one"
        request.status = RequestStatus.WAITING_FOR_GRAMMAR
        future = self._thread_pool().submit(self.structured.matcher, spec, request.eos_token_ids)
        self._compiling[request.request_id] = (request, future)

    def _thread_pool(self) -> ThreadPoolExecutor:
        """Half the CPU cores, 1 to 8 threads (vLLM's sizing), so one huge schema does not
        hold every other constrained request where cores allow."""
        if self._pool is None:
            workers = max(1, min((os.cpu_count() or 2) // 2, 8))
            self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar")
        return self._pool

    @property
    def pending(self) -> bool:
        return bool(self._compiling)

    def poll(self, wait_s: float = 0.0) -> list[GrammarFailure]:
        """Hand out finished compiles (waiting up to `wait_s` for the first when none is
        done: a core with nothing else to run need not spin); returns the failures."""
        if wait_s > 0 and self._compiling:
            wait([f for _, f in self._compiling.values()], timeout=wait_s, return_when=FIRST_COMPLETED)
        failures = []
        for request_id, (request, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            if request.status != RequestStatus.WAITING_FOR_GRAMMAR:
                continue  # finished meanwhile (aborted)
            try:
                request.matcher = future.result()
            except StructuredOutputError as exc:
                failures.append(GrammarFailure(request_id, str(exc)))
                continue
            request.status = RequestStatus.WAITING
        return failures

    def forget(self, request_ids: list[str]) -> None:
        """Stop waiting for these (aborted) requests' compiles."""
        for request_id in request_ids:
            entry = self._compiling.pop(request_id, None)
            if entry is not None:
                entry[1].cancel()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
