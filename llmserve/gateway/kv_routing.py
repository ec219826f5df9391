"""kv_aware routing: each request to the replica whose KV cache already holds most of its prompt,
weighed against how busy the replicas are.

For every route with `routing: kv_aware` this holds an index of the replicas' blocks (kv_index.py)
fed by their event streams (kv_subscriber.py), and the model's tokenizer (kv_prompt.py). A
replica's worth for a prompt is the cached prefix it saves, in tokens, each block weighted by its
best medium (`tier_weights`: GPU over CPU over DISK; a prompt routed there in the last
`expect_s` counts as on its GPU until its events tell), less `load_weight_tokens` for each request
it has in flight; the highest wins, ties to the least busy. A replica whose stream is stale
counts as holding nothing; when no candidate's stream is live, or the prompt cannot be read
(no tokenizer, a malformed body, a LoRA route: the adapter's cache key is the replica's own), the
router falls back to least outstanding.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Protocol

import httpx
import zmq.asyncio

from llmserve.gateway.config import GatewayConfig, KVRoutingConfig
from llmserve.gateway.kv_index import KVIndex
from llmserve.gateway.kv_prompt import KVPrompt, prompt_ids
from llmserve.gateway.kv_subscriber import KVStream, QuietLog

logger = logging.getLogger(__name__)

TOKENIZER_RETRY_S = 5.0  # how often the replicas are asked again for their model's folder


class Candidate(Protocol):  # what the choice reads of a replica (router.Replica)
    url: str

    @property
    def outstanding(self) -> int: ...


@dataclass(frozen=True, slots=True)
class KVChoice:
    replica: Candidate
    decision: str  # kv_prefix (it holds some of the prompt), kv_load (none does: the least busy)
    cached_tokens: float  # the weighted prefix it holds


class KVRouting:
    def __init__(self, config: GatewayConfig, metrics=None):
        self.settings: dict[str, KVRoutingConfig] = {
            alias: route.kv_events for alias, route in config.models.items()
            if route.routing == "kv_aware" and route.kv_events is not None
        }  # fmt: skip
        self.loras = {alias: config.models[alias].lora for alias in self.settings}
        self.urls = {alias: config.models[alias].replicas for alias in self.settings}
        self.indexes = {alias: KVIndex(s.tier_weights) for alias, s in self.settings.items()}
        self.tokenizers: dict[str, object] = {}
        self.metrics = metrics
        self.quiet = QuietLog()
        for alias, index in self.indexes.items():
            for url in self.urls[alias]:
                index.add(url)
                if url not in self.settings[alias].replicas:  # stale for good: routed by load
                    index.set_live(url, False, "no kv_events endpoint configured")

    def routes(self) -> list[str]:
        return list(self.settings)

    async def run(self, client: httpx.AsyncClient) -> None:
        """Subscribe to every replica's events and find the tokenizers, until cancelled."""
        context = zmq.asyncio.Context()
        tasks = []
        try:
            for alias, settings in self.settings.items():
                for url, source in settings.replicas.items():
                    stream = KVStream(url, source, self.indexes[alias], settings, context, self.metrics)
                    tasks.append(asyncio.create_task(_forever(stream.run, f"KV events of {url}")))
                tasks.append(asyncio.create_task(self._find_tokenizer(alias, client)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            context.destroy(linger=0)

    async def _find_tokenizer(self, alias: str, client: httpx.AsyncClient) -> None:
        from llmserve.tokenizer import load_tokenizer

        path = self.settings[alias].tokenizer
        while path is None:
            path = await _model_root(client, self.urls[alias])
            if path is None:
                await asyncio.sleep(TOKENIZER_RETRY_S)
        try:
            self.tokenizers[alias] = await asyncio.to_thread(load_tokenizer, path)
            logger.info("kv_aware routing of %s: the tokenizer of %s", alias, path)
        except Exception as exc:  # a broken folder: text prompts are routed by load
            logger.error("kv_aware routing of %s: cannot load the tokenizer of %s (%s): prompts sent as text are "
                         "routed by load", alias, path, exc)  # fmt: skip

    # -- per request ----------------------------------------------------------------------
    async def prompt(self, alias: str, payload: dict, path: str) -> KVPrompt | None:
        """The request's prompt in token ids (None: it cannot be read here)."""
        if alias not in self.settings or self.loras[alias] is not None:
            return None
        prompt = payload.get("prompt") if path == "/v1/completions" else None
        tokenizer = self.tokenizers.get(alias)
        try:
            if isinstance(prompt, list) and prompt and type(prompt[0]) is int:  # ids: nothing to render
                ids = prompt_ids(payload, path, tokenizer)
            else:  # templates and tokenizers off the event loop
                ids = await asyncio.to_thread(prompt_ids, payload, path, tokenizer)
        except Exception as exc:  # routing never fails a request: this one goes by load
            self.quiet.warn("prompt", "kv_aware routing of %s: a prompt could not be read (%r): routed by load",
                            alias, exc)  # fmt: skip
            return None
        return KVPrompt(ids) if ids is not None else None

    def choose(self, alias: str, candidates: list[Candidate], prompt: KVPrompt | None, max_imbalance: int,
               turn: int) -> KVChoice | None:  # fmt: skip
        """The replica for `prompt` among `candidates` (each with `url` and `outstanding`); None:
        nothing to go by (route by load)."""
        index = self.indexes.get(alias)
        if index is None or prompt is None:
            return None
        settings = self.settings[alias]
        block_size = settings.block_size or index.block_size(self.urls[alias])
        least = min(r.outstanding for r in candidates)
        allowed = [r for r in candidates if r.outstanding <= least + max_imbalance]
        if block_size is None or not any(index.live(r.url) for r in allowed):
            return None
        hashes = prompt.hashes(block_size)
        scored = []
        for r in allowed:
            cached = index.prefix(r.url, hashes).weighted * block_size if index.live(r.url) else 0.0
            scored.append((cached - settings.load_weight_tokens * r.outstanding, -r.outstanding, cached, r))
        best = max(s[:2] for s in scored)
        tied = [s for s in scored if s[:2] == best]
        _, _, cached, replica = tied[turn % len(tied)]
        if index.live(replica.url):  # its prompt's blocks will be there: the next ones sharing it follow
            index.expect(replica.url, hashes, time.monotonic() + settings.expect_s)
        return KVChoice(replica, "kv_prefix" if cached > 0 else "kv_load", cached)

    def snapshot(self) -> dict[str, dict]:
        """Per route: whether its tokenizer is loaded, and per replica its stream live or why not,
        blocks per medium."""
        return {alias: {"tokenizer": alias in self.tokenizers, "replicas": index.snapshot()}
                for alias, index in self.indexes.items()}  # fmt: skip


async def _forever(run, what: str) -> None:
    """`run()` again after anything but a cancel goes wrong (never down for good)."""
    while True:
        try:
            await run()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("%s: the subscriber failed; starting it again", what)
            await asyncio.sleep(1.0)


async def _model_root(client: httpx.AsyncClient, urls: list[str]) -> str | None:
    """The model folder a replica names in /v1/models (`root`), if this host has it."""
    for url in urls:
        try:
            models = (await client.get(f"{url}/v1/models", timeout=2.0)).json().get("data") or []
        except (httpx.HTTPError, ValueError, AttributeError):
            continue
        for card in models:
            root = card.get("root") if isinstance(card, dict) else None
            if isinstance(root, str) and os.path.exists(root):
                return root
    return None
