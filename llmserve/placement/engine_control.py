"""The calls that put an engine to sleep and wake it, as a model server answers them.

The Triton chat model takes these `endpoint`s beside the OpenAI ones (when its config enables
sleep mode), so a placement controller drives every engine over the connection it already
has; the answers are JSON:
- `/sleep` {"level": 1|2}: {"is_sleeping": true, "level": n}; 409 while requests are in flight;
- `/wake_up`: {"is_sleeping": false};
- `/is_sleeping`: {"is_sleeping": bool};
- `/footprint`: the engine's `memory_footprint()` (weight and KV bytes, bytes held now, the
  device's size) and `is_sleeping`.
"""

from __future__ import annotations

import json

from llmserve.openai.errors import error_body

SLEEP, WAKE_UP, IS_SLEEPING, FOOTPRINT = "/sleep", "/wake_up", "/is_sleeping", "/footprint"
CONTROL_ENDPOINTS = (SLEEP, WAKE_UP, IS_SLEEPING, FOOTPRINT)


async def control_call(engine, endpoint: str, body: bytes) -> tuple[int, dict]:
    """(status, JSON body) of one control call on an AsyncEngine."""
    if endpoint == SLEEP:
        try:
            args = json.loads(body or b"{}")
        except ValueError:
            return 400, error_body(400, 'the /sleep body must be JSON such as {"level": 1}')
        level = args.get("level", 1) if isinstance(args, dict) else None
        if level not in (1, 2) or isinstance(level, bool):
            return 400, error_body(400, f"sleep level must be 1 or 2, got {level!r}")
        if not await engine.sleep(level):
            return 409, error_body(409, "requests are in flight: the engine sleeps only when idle", code="busy")
        return 200, {"is_sleeping": True, "level": level}
    if endpoint == WAKE_UP:
        await engine.wake_up()
        return 200, {"is_sleeping": False}
    if endpoint == IS_SLEEPING:
        return 200, {"is_sleeping": await engine.is_sleeping()}
    if endpoint == FOOTPRINT:
        return 200, {**await engine.memory_footprint(), "is_sleeping": await engine.is_sleeping()}
    return 404, error_body(404, f"no control call {endpoint!r}; there are {', '.join(CONTROL_ENDPOINTS)}")
