"""One streamed request to an OpenAI-compatible server, timed on the client.

Only HTTP and JSON here: the online benchmark must measure what a real client sees, so
it never touches engine internals and works against any OpenAI-compatible server.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


def add_target_args(parser) -> None:
    """The server a long-running HTTP client drives (`bench soak`, `bench aborts`)."""
    parser.add_argument("--base-url", required=True, help="the server or gateway (http://host:port)")
    parser.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=None)


def open_client(request_timeout: float) -> httpx.AsyncClient:
    """The benchmark's HTTP client: no cap on connections (httpx's default of 100 would
    queue requests silently) and no proxy between the client and the server measured."""
    timeout = httpx.Timeout(request_timeout, connect=min(30.0, request_timeout))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)


@dataclass
class Target:
    """Where and how to send: one endpoint of one server."""

    base_url: str
    endpoint: str  # /v1/completions or /v1/chat/completions
    model: str | None
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    return_token_ids: bool = False  # ask for the output's token ids (vLLM's extension)

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/" + self.endpoint.lstrip("/")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def payload(self, prompt: list[int] | str, max_tokens: int) -> dict:
        body: dict = {"stream": True, "stream_options": {"include_usage": True}, "temperature": self.temperature}
        if self.model is not None:
            body["model"] = self.model
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
            body["max_completion_tokens"] = max_tokens
        else:
            body["prompt"] = prompt
            body["max_tokens"] = max_tokens
        if self.ignore_eos:
            body["ignore_eos"] = True  # a vLLM extension; sent only when asked for
        if self.return_token_ids:
            body["return_token_ids"] = True  # likewise
        return body


@dataclass
class RequestResult:
    """What the client saw of one request; times in seconds."""

    success: bool = False
    prompt_len: int = 0  # the server's count (usage) when it reports one, else ours
    output_tokens: int = 0  # usage.completion_tokens when reported, else token chunks
    start: float = 0.0  # when it was sent, since the benchmark started
    ttft: float = 0.0
    latency: float = 0.0  # end to end: sent -> last byte
    itl: list[float] = field(default_factory=list)  # gaps between token-carrying chunks
    token_times: list[float] = field(default_factory=list)  # chunk arrivals, since the benchmark started
    error: str = ""
    sent_wall_time: float = 0.0  # time.time() when sent: to line it up with a server's own log
    response_id: str = ""  # the "id" of the stream's chunks, as the server named the request
    text: str = ""  # the generated text (completions' choices[0].text, concatenated)
    output_ids: list[int] = field(default_factory=list)  # with Target.return_token_ids, if the server sent them

    @property
    def end(self) -> float:
        return self.start + self.latency

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for one-token outputs."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def _carries_tokens(choice: dict, chat: bool) -> bool:
    """Whether a stream chunk brings generated tokens (not a role-only or finish-only chunk).

    A token whose text is not complete yet (part of a UTF-8 character) arrives as an
    empty-text chunk with no finish reason, so emptiness alone does not decide."""
    if chat:
        delta = choice.get("delta") or {}
        text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
        if delta.get("role") and not text:
            return False
    else:
        text = choice.get("text")
    return bool(text) or choice.get("finish_reason") is None


async def send(
    client: httpx.AsyncClient, target: Target, prompt: list[int] | str, prompt_len: int, max_tokens: int, t0: float
) -> RequestResult:
    """Send one streamed request; every failure is returned in the result, never raised.

    `t0` is the benchmark's start on the perf_counter clock."""
    res = RequestResult(prompt_len=prompt_len)
    sent = time.perf_counter()
    res.sent_wall_time = time.time()
    res.start = sent - t0
    try:
        await _stream(client, target, prompt, max_tokens, res, sent, t0)
    except Exception as exc:  # noqa: BLE001 - any failure (refused, reset, bad JSON) is a failed request
        res.error = f"{type(exc).__name__}: {exc}"
    if not res.latency:  # failed part-way: how long it held its slot
        res.latency = time.perf_counter() - sent
    res.success = not res.error
    return res


async def _stream(
    client: httpx.AsyncClient,
    target: Target,
    prompt: list[int] | str,
    max_tokens: int,
    res: RequestResult,
    sent: float,
    t0: float,
) -> None:
    """Read the SSE stream into `res`; sets `res.error` for an HTTP or in-stream error."""
    last = sent
    chunks = 0
    usage: dict = {}
    async with client.stream(
        "POST", target.url, json=target.payload(prompt, max_tokens), headers=target.headers()
    ) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")
            res.error = f"HTTP {resp.status_code}: {body[:300]}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments, event names
            now = time.perf_counter()
            data = line[5:].strip()
            if data == "[DONE]":
                break
            msg = json.loads(data)
            if "error" in msg:
                res.error = f"stream error: {json.dumps(msg['error'])[:300]}"
                return
            usage = msg.get("usage") or usage
            res.response_id = res.response_id or str(msg.get("id") or "")
            choices = msg.get("choices") or []
            if choices and not target.chat:  # a finish-only chunk may still bring a token's ids
                res.text += choices[0].get("text") or ""
                res.output_ids += choices[0].get("token_ids") or []
            if not choices or not _carries_tokens(choices[0], target.chat):
                continue
            if chunks == 0:
                res.ttft = now - sent
            else:
                res.itl.append(now - last)
            res.token_times.append(now - t0)
            last = now
            chunks += 1
        res.latency = time.perf_counter() - sent
    if chunks == 0:
        res.error = "the stream ended without any generated token"
        return
    res.output_tokens = int(usage.get("completion_tokens") or chunks)
    res.prompt_len = int(usage.get("prompt_tokens") or res.prompt_len)
