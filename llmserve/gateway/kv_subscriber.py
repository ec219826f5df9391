"""One replica's KV event stream, subscribed: batches from its PUB socket applied to the index in
sequence, gaps filled from its replay socket, and the replay socket asked every
`probe_interval_s` for anything after the last batch applied, which both catches a batch lost
at the end of a burst and tells whether the publisher still answers.

- a gap (a batch ahead of the next expected one) is filled from the replay socket; what the
  publisher no longer keeps is lost: the replica's blocks are forgotten and the index goes on
  from the batches it has (a subset of what the replica holds, never a block it dropped);
- no answer from the replay socket within `probe_timeout_s` (the publisher gone, or its replica
  restarting): the stream is stale (the router falls back to load for this replica) and its
  blocks forgotten; at the next answer the index is rebuilt from the publisher's kept batches;
- a message that is not a KV event batch is ignored with a log line (at most one per kind and
  replica every 10 s) and counted; it never stops the stream.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from llmserve.gateway.config import KVEventsSource, KVRoutingConfig
from llmserve.gateway.kv_index import Applied, KVIndex
from llmserve.gateway.kv_wire import BadMessage, KVBatch, decode_payload, decode_published, read_seq

logger = logging.getLogger(__name__)

END = -1  # the replay socket's last frame: no more kept batches


class QuietLog:
    """Warnings at most once per `every_s` for each key, with how many were held back."""

    def __init__(self, every_s: float = 10.0):
        self.every_s = every_s
        self.last: dict[str, float] = {}
        self.held: dict[str, int] = {}

    def warn(self, key: str, message: str, *args) -> None:
        now = time.monotonic()
        if now - self.last.get(key, float("-inf")) < self.every_s:
            self.held[key] = self.held.get(key, 0) + 1
            return
        held = self.held.pop(key, 0)
        self.last[key] = now
        logger.warning(message + (f" ({held} more since the last such line)" if held else ""), *args)


class KVStream:
    """The subscription to one replica's events (`run` until cancelled)."""

    def __init__(self, url: str, source: KVEventsSource, index: KVIndex, settings: KVRoutingConfig,
                 context: zmq.asyncio.Context, metrics=None):  # fmt: skip
        self.url, self.source, self.index, self.settings = url, source, index, settings
        self.context = context
        self.metrics = metrics  # GatewayMetrics (kv_events_bad, kv_gaps), or None
        self.topic = source.topic.encode()
        self.replay: zmq.asyncio.Socket | None = None
        self.quiet = QuietLog()
        index.add(url)

    async def run(self) -> None:
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.connect(self.source.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        try:
            next_probe = 0.0
            while True:
                if self.source.replay_endpoint is not None and time.monotonic() >= next_probe:
                    await self.probe()
                    next_probe = time.monotonic() + self.settings.probe_interval_s
                wait_s = next_probe - time.monotonic() if self.source.replay_endpoint else 1.0
                if await sub.poll(max(1, int(wait_s * 1000))):
                    await self.received(await sub.recv_multipart())
        finally:
            sub.close(linger=0)
            self._close_replay()

    async def received(self, frames: list[bytes]) -> None:
        try:
            batch = decode_published(frames, self.topic)
        except BadMessage as exc:
            self._bad(str(exc))
            return
        applied = self.index.apply(self.url, batch)
        if applied is Applied.GAP:
            await self.fill(batch)
        elif applied is Applied.APPLIED and self.source.replay_endpoint is None:
            self.index.set_live(self.url, True)  # (without a replay socket, in sequence is all it can tell)

    async def fill(self, batch: KVBatch) -> None:
        """`batch` came after a gap: the missing ones from the replay socket, then it."""
        start = self.index.replicas[self.url].next_seq
        if self.source.replay_endpoint is not None:
            await self.probe()
        if self.index.apply(self.url, batch) is Applied.GAP:  # the publisher no longer keeps them
            self._gap_lost(start, batch.seq)
            self.index.reset(self.url, batch.seq)
            self.index.apply(self.url, batch)
            if self.source.replay_endpoint is None:  # (with one, the probes say whether it is live)
                self.index.set_live(self.url, True)
        elif self.metrics is not None:
            self.metrics.kv_gaps.labels(self.url, "filled").inc()

    async def probe(self) -> None:
        """Ask the replay socket for the batches after the last one applied, and apply them; no
        answer in time: the stream is stale and the replica's blocks forgotten."""
        r = self.index.replicas[self.url]
        start = r.next_seq
        try:
            batches = await asyncio.wait_for(self._replayed(start), self.settings.probe_timeout_s)
        except TimeoutError:
            self._close_replay()  # (a late answer must not be read as the next one's)
            if r.live or r.why_stale == "not synced yet":
                logger.warning("KV events of %s: the replay socket %s did not answer within %.1f s: stale, "
                               "routed by load until it does", self.url, self.source.replay_endpoint,
                               self.settings.probe_timeout_s)  # fmt: skip
            self.index.set_live(self.url, False, "the publisher does not answer")
            self.index.reset(self.url, 0)  # rebuilt from its kept batches when it answers again
            return
        for seq, payload in batches:
            try:
                batch = decode_payload(seq, payload)
            except BadMessage as exc:
                self._bad(str(exc))
                self.index.reset(self.url, seq + 1)  # its content is lost: start over after it
                continue
            if self.index.apply(self.url, batch) is Applied.GAP:  # it no longer keeps the ones before
                if start > 0:
                    self._gap_lost(r.next_seq, seq)
                self.index.reset(self.url, seq)
                self.index.apply(self.url, batch)
        self.index.set_live(self.url, True)

    async def _replayed(self, start: int) -> list[tuple[int, bytes]]:
        if self.replay is None:
            self.replay = self.context.socket(zmq.DEALER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.connect(self.source.replay_endpoint)
        await self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            frames = await self.replay.recv_multipart()
            if len(frames) != 3 or frames[0] != b"":
                self._bad(f"a replay answer of {len(frames)} frames")
                continue
            try:
                seq = read_seq(frames[1])
            except BadMessage as exc:
                self._bad(str(exc))
                continue
            if seq == END:
                return out
            out.append((seq, frames[2]))

    def _close_replay(self) -> None:
        if self.replay is not None:
            self.replay.close(linger=0)
            self.replay = None

    def _bad(self, why: str) -> None:
        self.quiet.warn("bad", "KV events of %s: ignored a message: %s", self.url, why)
        if self.metrics is not None:
            self.metrics.kv_events_bad.labels(self.url).inc()

    def _gap_lost(self, first: int, until: int) -> None:
        self.quiet.warn("gap", "KV events of %s: batches %d..%d are lost (the publisher no longer keeps them): "
                        "its blocks are forgotten, learned again from batch %d", self.url, first, until - 1, until)  # fmt: skip
        if self.metrics is not None:
            self.metrics.kv_gaps.labels(self.url, "lost").inc()
