"""Schemathesis hooks for tests/test_schemathesis.py (loaded through SCHEMATHESIS_HOOKS).

A body may carry `request_timeout_s` (>= 1): a deadline the client asks for, answered 504 when
the request runs past it (openai/deadline.py, tested in its own tests). On a loaded machine a
fuzzed 1-second deadline is reached by an ordinary request, and that 504 is the answer asked
for, not a server error: generated deadlines are raised to the fuzz run's own request timeout."""

from __future__ import annotations

import schemathesis

LEAST_DEADLINE_S = 60.0


@schemathesis.hook
def map_body(context, body):
    if isinstance(body, dict) and isinstance(body.get("request_timeout_s"), int | float):
        body["request_timeout_s"] = max(body["request_timeout_s"], LEAST_DEADLINE_S)
    return body
