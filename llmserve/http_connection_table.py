"""Which connections a server holds, per client, and which to let go when a new one comes over
the caps (no I/O here: the HTTP protocol acts on the answer).

A connection is *waiting* while the server needs bytes from its client to go on: from its
accept, or the end of its last response, until its request (head and body) has arrived. It is
*busy* while the server works on a whole request. Over a cap, the connection that has waited
longest is let go (shed) so the new one gets in: held-open connections that send nothing (or
one byte now and then) cannot keep real clients out. Only when every connection of the cap is
busy is the new one refused.
"""

from __future__ import annotations

import logging
import resource
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class Admission:
    shed: list[Hashable] = field(default_factory=list)  # connections to close so the new one fits
    refused: int | None = None  # the new connection's status (429 over its client's cap, 503 over the total)


class ConnectionTable:
    def __init__(self, max_connections: int, max_per_client: int = 0) -> None:
        """`max_per_client` 0: no cap per client (behind a proxy every client has its address)."""
        if max_connections < 1 or max_per_client < 0:
            raise ValueError(f"max_connections must be >= 1 and max_per_client >= 0; got {max_connections}, "
                             f"{max_per_client}")  # fmt: skip
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self._client: dict[Hashable, str] = {}  # connection -> its client
        self._count: dict[str, int] = {}  # client -> connections held
        # the waiting connections, longest waiting first (an OrderedDict: taking the first is O(1), where
        # a dict's first after many removals from its front is a scan over their tombstones)
        self._waiting: OrderedDict[Hashable, None] = OrderedDict()
        self._waiting_of: dict[str, OrderedDict[Hashable, None]] = {}  # the same, per client

    def __len__(self) -> int:
        return len(self._client)

    def clients(self) -> dict[str, int]:
        return dict(self._count)

    def admit(self, conn: Hashable, client: str) -> Admission:
        """A new connection from `client`: held (and waiting) unless refused; the connections to
        shed for it are forgotten here already."""
        answer = Admission()
        if self.max_per_client and self._count.get(client, 0) >= self.max_per_client:
            if not self._shed_one(self._waiting_of.get(client), answer):
                answer.refused = 429
                return answer
        if len(self._client) >= self.max_connections and not self._shed_one(self._waiting, answer):
            answer.refused = 503
            return answer
        self._client[conn] = client
        self._count[client] = self._count.get(client, 0) + 1
        self.waiting(conn)
        return answer

    def waiting(self, conn: Hashable) -> None:
        """`conn` waits for its client again (a new request): it goes to the end of the line."""
        client = self._client.get(conn)
        if client is None:
            return
        self._waiting[conn] = None
        self._waiting.move_to_end(conn)
        per_client = self._waiting_of.get(client)
        if per_client is None:
            per_client = self._waiting_of[client] = OrderedDict()
        per_client[conn] = None
        per_client.move_to_end(conn)

    def busy(self, conn: Hashable) -> None:
        """`conn`'s request has arrived whole: the server works on it, never shed."""
        client = self._client.get(conn)
        if client is not None:
            self._unwait(conn, client)

    def remove(self, conn: Hashable) -> None:
        client = self._client.pop(conn, None)
        if client is None:
            return
        self._unwait(conn, client)
        left = self._count[client] - 1
        if left:
            self._count[client] = left
        else:
            del self._count[client]

    def _unwait(self, conn: Hashable, client: str) -> None:
        self._waiting.pop(conn, None)
        per_client = self._waiting_of.get(client)
        if per_client is not None:
            per_client.pop(conn, None)
            if not per_client:
                del self._waiting_of[client]

    def _shed_one(self, line: OrderedDict[Hashable, None] | None, answer: Admission) -> bool:
        if not line:
            return False
        victim = next(iter(line))
        self.remove(victim)
        answer.shed.append(victim)
        return True


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to the hard limit; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # some systems refuse RLIM_INFINITY as a soft limit
            pass
    return soft


def connection_cap(requested: int) -> int:
    """`requested`, kept to half the open-file limit (raised to its hard limit first): the other
    half stays for upstream connections (the gateway opens one per request it forwards), model
    files, logs and the engine's pipes, so clients can never make the process run out."""
    soft = raise_open_file_limit()
    if soft == resource.RLIM_INFINITY:
        return requested
    cap = max(1, soft // 2)
    if requested > cap:
        logger.warning("max connections %d kept to %d: half this process's open-file limit (%d)", requested, cap, soft)
        return cap
    return requested
