"""`--request-timing-log PATH`: one JSON line per finished request with its wall-clock
times, for finding where a slow first token spent its time (scripts/gpu/request_timeline.py
joins it with `bench serve --save-detailed`'s client-side view):

    arrival_time          the HTTP handler took the request (before tokenization)
    sent_time             the API process sent it to the engine core (its stream started)
    queued_time           the engine core process read it
    first_scheduled_time  its first step was scheduled
    first_token_core_time the core finished the step that made its first token
    first_token_time      the API process had that token
    finished_time         the API process had its last token

plus request_id, finish_reason, prompt_tokens and output_tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmserve.engine.output_processor import IterationStats

TIMES = ("arrival_time", "sent_time", "queued_time", "first_scheduled_time", "first_token_core_time",
         "first_token_time", "finished_time")  # fmt: skip


class RequestTimingLog:
    """A stats listener (AsyncEngine.add_stats_listener) that appends to `path`."""

    def __init__(self, path: str | Path) -> None:
        self._file = Path(path).open("a", buffering=1, encoding="utf-8")  # line-buffered: survives a kill

    def observe(self, it: IterationStats) -> None:
        if self._file.closed:
            return
        for f in it.finished:
            line = {"request_id": f.request_id, "finish_reason": f.finish_reason,
                    "prompt_tokens": f.num_prompt_tokens, "output_tokens": f.num_generation_tokens}  # fmt: skip
            line |= {k: getattr(f.timeline, k) for k in TIMES}
            self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._file.close()
