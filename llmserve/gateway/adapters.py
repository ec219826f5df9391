"""LoRA adapters on `llmserve serve` replicas, as the gateway sees them: which replica holds which
adapter (from each replica's /v1/models, and the loads the gateway made), and loading one on
demand onto the replica a request goes to.

A route with `lora: NAME` and `lora_path: FOLDER` (the adapter's folder as the replicas see it)
prefers the replicas that hold NAME (router.py), and when the picked one does not, loads it
there first with POST /v1/load_lora_adapter (the route's admin key). An adapter the replica
dropped since (unloaded by an operator, or a restart) answers 404: it is loaded again and the
request sent once more.
"""

from __future__ import annotations

import asyncio
import json

import httpx

from llmserve.gateway.config import ModelRoute
from llmserve.gateway.opened import UpstreamFailed
from llmserve.openai.errors import error_body


class AdapterHoldings:
    """Replica URL -> the LoRA adapters it serves (model cards with a parent in its /v1/models)."""

    def __init__(self) -> None:
        self._held: dict[str, set[str]] = {}
        self._loading: dict[tuple[str, str], asyncio.Lock] = {}

    def holds(self, url: str, name: str) -> bool:
        return name in self._held.get(url, ())

    def seen(self, url: str, models: dict) -> None:
        """What a replica's /v1/models says it serves now."""
        cards = models.get("data") if isinstance(models, dict) else None
        if isinstance(cards, list):
            self._held[url] = {c["id"] for c in cards if isinstance(c, dict) and c.get("parent") and "id" in c}

    def dropped(self, url: str, name: str) -> None:
        self._held.get(url, set()).discard(name)

    async def ensure_loaded(self, client: httpx.AsyncClient, route: ModelRoute, url: str, timeout_s: float) -> bool:
        """Load the route's adapter onto `url` unless it holds it already; True when it was
        loaded now. UpstreamFailed when the replica refuses or cannot be reached."""
        name = route.lora
        if name is None or route.lora_path is None or self.holds(url, name):
            return False
        lock = self._loading.setdefault((url, name), asyncio.Lock())
        async with lock:  # one load per replica and adapter at a time; the others wait for it
            if self.holds(url, name):
                return False
            body = {"lora_name": name, "lora_path": route.lora_path}
            try:
                resp = await client.post(url + "/v1/load_lora_adapter", json=body, headers=route.control_headers(),
                                         timeout=timeout_s)  # fmt: skip
            except httpx.HTTPError as exc:
                raise UpstreamFailed(
                    f"loading the adapter {name!r} on {url}: {type(exc).__name__}", unavailable=True
                ) from exc
            if resp.status_code != 200 and _code(resp) != "already_loaded":
                message = (
                    f"the replica could not load the LoRA adapter {name!r} ({resp.status_code}): {resp.text[:300]}"
                )
                content = error_body(502, message, code="adapter_load_failed")
                raise UpstreamFailed(message, 502, json.dumps(content).encode())
            self._held.setdefault(url, set()).add(name)
            return True


def _code(resp: httpx.Response) -> str | None:
    try:
        return resp.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
