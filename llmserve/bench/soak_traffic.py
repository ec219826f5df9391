"""The traffic of `bench soak`: a mix of what clients of a chat platform send, and one
request's outcome as a client sees it.

Each request is drawn at random: chat (with the shared system prompt most chat front-ends
send) or a plain completion; streamed or not; a short or a long prompt; and sometimes a
client that leaves before the end (it closes the stream or gives up waiting).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx

_WORDS = ("time year people way day thing world life hand part child eye place work week case point "
          "number group problem fact system program question government company").split()  # fmt: skip
SYSTEM_PROMPT = ("You are a helpful assistant for a software company. Answer briefly and precisely, "
                 "use plain language, and say so when you do not know. " * 6).strip()  # fmt: skip
CHAT_SHARE, STREAM_SHARE, LONG_SHARE, LEAVE_SHARE = 0.6, 0.7, 0.2, 0.1


@dataclass(frozen=True)
class RequestPlan:
    chat: bool
    stream: bool
    prompt: str
    max_tokens: int
    leave_after_s: float | None  # a client that leaves this long after sending


@dataclass
class Outcome:
    ttft: float | None = None  # streamed requests only
    latency: float = 0.0
    output_tokens: int = 0
    error: str = ""
    error_kind: str = ""
    shed: bool = False  # 503 / 429: refused by design under load
    left: bool = False  # the client left on purpose

    def meets(self, ttft_slo_s: float, tpot_slo_s: float) -> bool:
        """Within the targets: TTFT and time per output token for a stream; for a whole reply,
        its latency within TTFT + TPOT x (tokens - 1)."""
        if self.ttft is None:
            return self.latency <= ttft_slo_s + tpot_slo_s * max(0, self.output_tokens - 1)
        if self.ttft > ttft_slo_s:
            return False
        return self.output_tokens < 2 or (self.latency - self.ttft) / (self.output_tokens - 1) <= tpot_slo_s


class TrafficMix:
    def __init__(self, base_url: str, model: str | None, headers: dict[str, str], max_tokens: int,
                 short_words: int = 40, long_words: int = 400, chat_share: float = CHAT_SHARE) -> None:  # fmt: skip
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.headers = headers
        self.max_tokens = max_tokens
        self.short_words = short_words  # a short prompt: 1/5 to all of this many words
        self.long_words = long_words  # a long one: 3/8 to all of this many
        self.chat_share = chat_share  # the rest are plain completions

    def draw(self, rng: random.Random) -> RequestPlan:
        if rng.random() < LONG_SHARE:
            words = rng.randint(max(1, self.long_words * 3 // 8), self.long_words)
        else:
            words = rng.randint(max(1, self.short_words // 5), self.short_words)
        leave = rng.uniform(0.05, 2.0) if rng.random() < LEAVE_SHARE else None
        return RequestPlan(chat=rng.random() < self.chat_share, stream=rng.random() < STREAM_SHARE,
                           prompt=" ".join(rng.choice(_WORDS) for _ in range(words)),
                           max_tokens=rng.randint(max(1, self.max_tokens // 4), self.max_tokens),
                           leave_after_s=leave)  # fmt: skip

    def request(self, plan: RequestPlan) -> tuple[str, dict]:
        body: dict = {"max_tokens": plan.max_tokens, "temperature": 0.7, "stream": plan.stream}
        if self.model:
            body["model"] = self.model
        if plan.stream:
            body["stream_options"] = {"include_usage": True}
        if plan.chat:
            body["messages"] = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": plan.prompt}]
            return self.base_url + "/v1/chat/completions", body
        body["prompt"] = plan.prompt
        return self.base_url + "/v1/completions", body


async def send_one(client: httpx.AsyncClient, mix: TrafficMix, plan: RequestPlan) -> Outcome:
    """Send `plan` and say what happened; never raises."""
    out = Outcome()
    start = time.perf_counter()
    try:
        if plan.leave_after_s is not None:
            try:
                await asyncio.wait_for(_exchange(client, mix, plan, out, start), plan.leave_after_s)
            except TimeoutError:
                out.left = True
        else:
            await _exchange(client, mix, plan, out, start)
    except Exception as exc:  # noqa: BLE001 - a failed request is an outcome
        out.error, out.error_kind = f"{type(exc).__name__}: {exc}"[:300], type(exc).__name__
    out.latency = time.perf_counter() - start
    return out


async def _exchange(client: httpx.AsyncClient, mix: TrafficMix, plan: RequestPlan, out: Outcome, start: float) -> None:
    url, body = mix.request(plan)
    if not plan.stream:
        resp = await client.post(url, json=body, headers=mix.headers)
        if _refused(resp.status_code, resp.text, out):
            return
        out.output_tokens = int((resp.json().get("usage") or {}).get("completion_tokens") or 0)
        return
    chunks = 0
    async with client.stream("POST", url, json=body, headers=mix.headers) as resp:
        if _refused(resp.status_code, (await resp.aread()).decode(errors="replace") if resp.status_code != 200 else "",
                    out):  # fmt: skip
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            msg = json.loads(line[5:])
            if "error" in msg:
                out.error, out.error_kind = json.dumps(msg["error"])[:300], "stream error"
                return
            if msg.get("usage"):
                out.output_tokens = int(msg["usage"].get("completion_tokens") or chunks)
            choice = (msg.get("choices") or [None])[0]
            if choice is not None and (choice.get("text") or (choice.get("delta") or {}).get("content")):
                chunks += 1
                if out.ttft is None:
                    out.ttft = time.perf_counter() - start
    out.output_tokens = out.output_tokens or chunks


def _refused(status: int, text: str, out: Outcome) -> bool:
    """Record a non-200 answer: shed load (503, 429) or an error of its status."""
    if status == 200:
        return False
    out.shed = status in (429, 503)
    out.error, out.error_kind = f"HTTP {status}: {text[:200]}", f"HTTP {status}"
    if out.shed:  # the server's reason (its error code), kept apart from failures
        try:
            out.error_kind = f"HTTP {status} {json.loads(text)['error'].get('code')}"
        except (ValueError, KeyError, TypeError, AttributeError):
            pass
    return True
