"""Triton replicas over HTTP (`http://host:port`, Triton's HTTP port): KServe v2 and Triton's
generate extension, with one aiohttp session.

The chat model's answers stream from `/v2/models/NAME/generate_stream`: one server-sent event
for each response of the decoupled model, `{"status": 200, "response": "data: {...}", ...}`.
That costs the gateway about half of what the same stream costs over gRPC (tritonclient's
asyncio client and its poller thread: 100-135 µs against 53-64 µs a response in one client
process, docs/history/benchmarks.md), and the gateway does it once for every token of every
stream. Closing the response early drops its connection, and Triton cancels the request
(the chat model aborts it in its engine), as cancelling the gRPC call does.

Failures are raised as tritonclient's InferenceServerException with the gRPC status name of
the HTTP status, so that one classification (triton_upstream.open_triton) serves both
transports; a connection that could not be made or broke is CallBroken.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import numpy as np
from tritonclient.utils import InferenceServerException, np_to_triton_dtype, triton_to_np_dtype

# Triton's HTTP status -> the gRPC status it gives for the same error
_STATUS = {400: "StatusCode.INVALID_ARGUMENT", 404: "StatusCode.NOT_FOUND", 429: "StatusCode.RESOURCE_EXHAUSTED",
           500: "StatusCode.INTERNAL", 501: "StatusCode.UNIMPLEMENTED", 503: "StatusCode.UNAVAILABLE"}  # fmt: skip
MAX_EVENT_BYTES = (
    1 << 28
)  # one event may hold a whole answer (n, logprobs: megabytes); aiohttp's own line limit is 512 KiB


class CallBroken(Exception):
    """The HTTP call itself failed: no connection (`refused`), or it broke midway."""

    def __init__(self, why: str, refused: bool) -> None:
        super().__init__(why)
        self.why, self.refused = why, refused


def _broken(exc: aiohttp.ClientError) -> CallBroken:
    if isinstance(exc, aiohttp.ClientConnectorError):
        return CallBroken(f"failed to connect: {exc}", refused=True)
    return CallBroken(f"{type(exc).__name__}: {exc}", refused=False)


def _error(status: int, text: str) -> InferenceServerException:
    try:
        message = json.loads(text).get("error") or text
    except (ValueError, AttributeError):
        message = text
    return InferenceServerException(str(message), status=_STATUS.get(status, f"HTTP {status}"))


class TritonHttp:
    """One aiohttp session for every Triton replica spoken to over HTTP, opened on first use
    (inside the running loop). No limit on its connections: each stream holds one."""

    def __init__(self, timeout: float = 600.0) -> None:
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                  timeout=aiohttp.ClientTimeout(total=None))  # fmt: skip
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _json(self, method: str, url: str, timeout: float, body: dict | None = None) -> tuple[int, str]:
        try:
            async with asyncio.timeout(timeout):
                async with self.session().request(method, url, json=body) as resp:
                    return resp.status, await resp.text()
        except aiohttp.ClientError as exc:
            raise _broken(exc) from exc

    async def metadata(self, url: str, model: str) -> dict:
        status, text = await self._json("GET", f"{url}/v2/models/{model}", self.timeout)
        if status != 200:
            raise _error(status, text)
        return json.loads(text)

    async def ready(self, url: str, model: str, timeout: float) -> bool:
        try:
            status, _ = await self._json("GET", f"{url}/v2/models/{model}/ready", timeout)
        except (CallBroken, TimeoutError):
            return False
        return status == 200

    async def infer(self, url: str, model: str, inputs: list[tuple[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """KServe v2 infer with these inputs (name, array: strings as an object array, or
        numbers); every output the model gives, by name."""
        body = {"inputs": [{"name": name, "shape": list(array.shape), "datatype": np_to_triton_dtype(array.dtype),
                            "data": array.reshape(-1).tolist()} for name, array in inputs]}  # fmt: skip
        status, text = await self._json("POST", f"{url}/v2/models/{model}/infer", self.timeout, body)
        if status != 200:
            raise _error(status, text)
        outputs = {}
        for tensor in json.loads(text).get("outputs", []):
            dtype = triton_to_np_dtype(tensor["datatype"]) or np.object_
            outputs[tensor["name"]] = np.array(tensor["data"], dtype=dtype).reshape(tensor["shape"])
        return outputs

    async def responses(self, url: str, model: str, inputs: dict[str, str]) -> AsyncIterator[tuple[int, str]]:
        """(status, text) of each response of a decoupled model whose outputs are `status` and
        `response` (the llmserve chat model), from generate_stream. Closed early, the call is
        dropped (Triton cancels the request); run to its end, the connection is kept."""
        try:
            resp = await self.session().post(f"{url}/v2/models/{model}/generate_stream", json=inputs)
        except aiohttp.ClientError as exc:
            raise _broken(exc) from exc
        ended = False
        try:
            if resp.status != 200:
                raise _error(resp.status, await resp.text())
            content = resp.content
            while True:
                try:
                    line = await content.readuntil(b"\n", max_size=MAX_EVENT_BYTES)
                except aiohttp.ClientError as exc:
                    raise _broken(exc) from exc
                if not line:  # the server ended the call
                    ended = True
                    return
                if not line.startswith(b"data:"):
                    continue  # the blank line between events
                event = json.loads(line[5:])
                if "error" in event:
                    raise InferenceServerException(str(event["error"]), status="StatusCode.INTERNAL")
                if "response" in event:  # (a final flag alone carries no outputs)
                    status = event.get("status", 200)
                    yield int(status[0] if isinstance(status, list) else status), event["response"]
        finally:
            if ended:
                resp.release()
            else:
                resp.close()  # drops the connection: Triton cancels the request
