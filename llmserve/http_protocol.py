"""The HTTP protocol of every llmserve server (`llmserve serve`, the gateway, `llmserve up`):
uvicorn's httptools protocol with limits on what one client can hold.

- **Head size** (http_head_limit): 431 past `max_header_bytes`.
- **Head time**: a request head not whole `header_timeout_s` after the connection opened, or
  after the last response ended, gets 408 and the connection closes (closed silently when
  nothing of it came: an idle connection). uvicorn has no such timeout: a connection that
  sends nothing, or a byte now and then, was held forever.
- **Body time**: `body_timeout_s` is the longest wait for the next piece of a request body
  (while the server is ready to read it): 408 and close. uvicorn waited forever for a
  Content-Length of 1,000 after 13 bytes.
- **Connections**: at most `max_connections` in all (kept to half the open-file limit) and
  `max_connections_per_client` from one address. Over a cap the connection that has waited
  longest for its client is shed, so a new one gets in; when all are busy with requests the new
  one gets 429 (its client's cap) or 503 (the total) and is closed (http_connection_table).

The errors are in OpenAI's error shape. Pass `uvicorn_options(limits)` to uvicorn.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

from llmserve.http_connection_table import ConnectionTable, connection_cap
from llmserve.http_head_limit import DEFAULT_MAX_HEADER_BYTES, head_limited_http
from llmserve.openai.errors import error_body

logger = logging.getLogger(__name__)

# nginx waits 60 s for a head and between body reads, Node 60 s for a head: programs send a head in
# one packet, so 10 s is plenty for any client and bounds what a silent one can hold
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 8192  # kept to half the open-file limit
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 1024  # above the gateway's pool of connections to one replica (1,000)
KEEP_ALIVE_TIMEOUT_S = 5  # uvicorn's: an idle connection between requests is closed after it


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_client: int = DEFAULT_MAX_CONNECTIONS_PER_CLIENT  # 0: no cap per client

    def __post_init__(self) -> None:
        if self.header_timeout_s <= 0 or self.body_timeout_s <= 0:
            raise ValueError("the header and body timeouts must be > 0")
        if self.max_connections < 1 or self.max_connections_per_client < 0:
            raise ValueError("max connections must be >= 1, and per client >= 0 (0: no cap)")


def uvicorn_options(limits: HttpLimits) -> dict:
    """uvicorn.Config / uvicorn.run keyword arguments: the protocol with `limits`."""
    return {"http": guarded_http(limits), "timeout_keep_alive": KEEP_ALIVE_TIMEOUT_S}


def guarded_http(limits: HttpLimits) -> type:
    """A protocol class for one server (its connections are counted together)."""
    table = ConnectionTable(connection_cap(limits.max_connections), limits.max_connections_per_client)
    shed_log = _ShedLog(table)

    class GuardedHttpTools(head_limited_http(limits.max_header_bytes)):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._timer: asyncio.TimerHandle | None = None
            self._waiting = False  # for the client's next request (its head, or its body)
            self._body = False  # waiting for its body (its head is whole)
            self._heard = False  # a byte of that request came

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            admission = table.admit(self, self.client[0] if self.client else "")
            for other in admission.shed:
                other._shed()
            shed_log.count(len(admission.shed), admission.refused)
            if admission.refused is not None:
                return self._answer(admission.refused, *_REFUSALS[admission.refused])
            self._wait_for_head()

        def connection_lost(self, exc) -> None:
            self._stop_timer()
            table.remove(self)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            self._heard = self._heard or self._waiting
            super().data_received(data)

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            if self._waiting and not self.transport.is_closing():  # the body may follow: its clock
                self._body = True
                self._start_timer(limits.body_timeout_s, self._body_timed_out)

        def on_body(self, body: bytes) -> None:
            super().on_body(body)
            if self._waiting and self._timer is not None:
                self._start_timer(limits.body_timeout_s, self._body_timed_out)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._stop_timer()
            self._body = False
            if self.cycle is not None and self.cycle.response_complete:
                self._wait_for_head()  # answered before its body ended (a 404): the next request's turn
            else:
                self._waiting = False
                table.busy(self)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.transport.is_closing() or (self._waiting and self._body):  # answered while its body comes
                return
            if self.cycle is None or self.cycle.response_complete:
                # nothing pipelined: the next request is the client's to send (it may have begun)
                self._wait_for_head(heard=self._in_head)
            elif self.cycle.more_body:  # a pipelined request started before its body came whole
                self._waiting = self._body = self._heard = True
                table.waiting(self)
                self._start_timer(limits.body_timeout_s, self._body_timed_out)

        def _wait_for_head(self, heard: bool = False) -> None:
            self._waiting, self._body, self._heard = True, False, heard
            table.waiting(self)
            self._start_timer(limits.header_timeout_s, self._head_timed_out)

        def _head_timed_out(self) -> None:
            self._timer = None
            if not self._heard:
                self.transport.close()  # idle: nothing to answer
            else:
                self._answer(408, f"the request head did not arrive within {limits.header_timeout_s:g} s",
                             "header_timeout")  # fmt: skip

        def _body_timed_out(self) -> None:
            self._timer = None
            cycle = self.cycle
            if self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue):
                # the server is not reading (a full buffer, a request waiting in line, a client waiting
                # for 100 Continue): not the client's delay
                return self._start_timer(limits.body_timeout_s, self._body_timed_out)
            self._answer(408, f"no part of the request body came for {limits.body_timeout_s:g} s", "body_timeout")

        def _shed(self) -> None:
            """Let go of this connection (it waited longest for its client) for a new one."""
            if self._heard:
                self._answer(503, "the server holds its most connections: this one, waiting longest for its "
                                  "request, was closed", "connection_shed")  # fmt: skip
            else:
                self._stop_timer()
                self.transport.close()

        def _answer(self, status: int, message: str, code: str) -> None:
            """Answer `status` and close. While a body comes, the app may have answered already
            (then only the close), and an app still reading it sees the client leave."""
            self._stop_timer()
            table.remove(self)
            cycle = self.cycle if self._body else None  # the request the body belongs to
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
            if (cycle is None or not cycle.response_started) and not self.transport.is_closing():
                self.transport.write(_response(status, message, code))
            self.transport.close()

        def _start_timer(self, seconds: float, callback) -> None:
            self._stop_timer()
            self._timer = self.loop.call_later(seconds, callback)

        def _stop_timer(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    return GuardedHttpTools


_REFUSALS = {
    429: ("this client holds its most connections to this server, all busy", "too_many_connections"),
    503: ("the server holds its most connections, all busy", "too_many_connections"),
}
_REASONS = {408: b"Request Timeout", 429: b"Too Many Requests", 503: b"Service Unavailable"}


def _response(status: int, message: str, code: str) -> bytes:
    body = json.dumps(error_body(status, message, code=code)).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, _REASONS[status], len(body)) + body)  # fmt: skip


class _ShedLog:
    """One warning at most every 10 s while connections are shed or refused, with the counts."""

    INTERVAL_S = 10.0

    def __init__(self, table: ConnectionTable) -> None:
        self.table = table
        self.shed = self.refused = 0
        self.last = -self.INTERVAL_S

    def count(self, shed: int, refused: int | None) -> None:
        if not shed and refused is None:
            return
        self.shed += shed
        self.refused += refused is not None
        now = time.monotonic()
        if now - self.last >= self.INTERVAL_S:
            busiest = max(self.table.clients().items(), key=lambda kv: kv[1], default=("-", 0))
            logger.warning("connections over the caps (%d in all, %d a client): %d waiting ones shed and %d new "
                           "ones refused since the last report; %d held, the most from one client %d (%s)",
                           self.table.max_connections, self.table.max_per_client, self.shed, self.refused,
                           len(self.table), busiest[1], busiest[0])  # fmt: skip
            self.shed = self.refused = 0
            self.last = now
