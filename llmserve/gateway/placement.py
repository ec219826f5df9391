"""Several Triton chat models sharing one GPU, driven from the gateway (docs/placement.md).

The gateway holds every request for a placed alias until its model is resident (the
placement controller wakes it, putting idle models to sleep first), for at most
`wake_timeout_s`, then refuses it with 503 `model_waking` and a Retry-After. The models are
driven over the same gRPC connection the requests use, with the chat model's control calls
(llmserve/placement/engine_control.py). Until every placed model has answered its footprint
(Triton still loading), requests pass through: an engine asleep wakes itself for a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from llmserve.gateway.config import GatewayConfig, PlacementConfig
from llmserve.gateway.metrics import GatewayMetrics
from llmserve.gateway.triton_upstream import TritonClients, _responses, _strings
from llmserve.placement.controller import PlacementController, WakeTimeout
from llmserve.placement.engine_control import FOOTPRINT, SLEEP, WAKE_UP
from llmserve.placement.footprint import Footprint, parse_budget
from llmserve.placement.model_state import ModelState, PlacedModel
from llmserve.placement.placement import Placement
from llmserve.placement.policies import make_policy

logger = logging.getLogger("llmserve.gateway.placement")

__all__ = ["GatewayPlacement", "TritonActuator", "WakeTimeout"]


class ControlFailed(Exception):
    """A control call got an answer other than the one expected."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class TritonActuator:
    """Puts Triton chat models to sleep and wakes them (alias -> replica address and model name)."""

    def __init__(self, clients: TritonClients, targets: dict[str, tuple[str, str]], timeout_s: float = 600.0):
        self.clients = clients
        self.targets = targets
        self.timeout_s = timeout_s

    async def call(self, alias: str, endpoint: str, body: dict | None = None) -> tuple[int, dict]:
        url, model = self.targets[alias]
        inputs = [_strings("request", [json.dumps(body or {})], [1]), _strings("endpoint", [endpoint], [1])]
        answers = [a async for a in _responses(self.clients.get(url), {"model_name": model, "inputs": inputs},
                                               self.timeout_s)]  # fmt: skip
        if not answers:
            raise ControlFailed(f"{alias}: {endpoint} got no answer")
        status, text = answers[-1]
        try:
            return status, json.loads(text)
        except ValueError:
            raise ControlFailed(f"{alias}: {endpoint} answered {status} with no JSON: {text[:200]!r}", status) from None

    async def sleep(self, name: str, level: int) -> bool:
        status, answer = await self.call(name, SLEEP, {"level": level})
        if status == 409:  # it had work after all
            return False
        if status != 200:
            raise ControlFailed(f"{name}: {SLEEP} answered {status}: {answer}")
        return True

    async def wake(self, name: str) -> None:
        status, answer = await self.call(name, WAKE_UP)
        if status != 200:
            raise ControlFailed(f"{name}: {WAKE_UP} answered {status}: {answer}")

    async def footprint(self, name: str) -> dict:
        status, answer = await self.call(name, FOOTPRINT)
        if status != 200:
            raise ControlFailed(f"{name}: {FOOTPRINT} answered {status}: {answer}", status)
        return answer


class GatewayPlacement:
    def __init__(self, config: PlacementConfig, gateway: GatewayConfig, clients: TritonClients,
                 metrics: GatewayMetrics) -> None:  # fmt: skip
        self.config = config
        self.metrics = metrics
        targets = {a: (gateway.models[a].replicas[0], gateway.models[a].model or a) for a in config.models}
        self.actuator = TritonActuator(clients, targets, gateway.upstream_timeout_s)
        self.controller: PlacementController | None = None  # once every model answered its footprint
        self.error: str | None = None  # why the controller could not start (a budget too small)

    def manages(self, alias: str) -> bool:
        return alias in self.actuator.targets

    # -- requests --------------------------------------------------------------------------
    def resident(self, alias: str) -> bool:
        """Whether a request for `alias` runs at once (resident and not drained)."""
        return self.controller is None or self.controller.placement.models[alias].runnable

    async def acquire(self, alias: str) -> bool:
        """Wait until `alias` is resident (WakeTimeout after the wait); True if the request
        now counts as in flight there (release it), False if placement is not running yet."""
        if self.controller is None:
            return False
        try:
            await self.controller.acquire(alias)
        except WakeTimeout:
            self.metrics.wake_timeouts.labels(alias).inc()
            raise
        return True

    def release(self, alias: str) -> None:
        if self.controller is not None:
            self.controller.release(alias)

    # -- running ---------------------------------------------------------------------------
    async def _start(self) -> PlacementController:
        rows = {a: await self.actuator.footprint(a) for a in self.config.models}
        device_total = max(int(r.get("device_total_bytes", 0)) for r in rows.values()) or None
        budget = parse_budget(self.config.gpu_memory_budget, device_total)
        models = [PlacedModel(a, Footprint(int(r["weight_bytes"]), int(r["kv_cache_bytes"]), int(r.get("overhead_bytes", 0))),
                              ModelState.ASLEEP if r.get("is_sleeping") else ModelState.RESIDENT)
                  for a, r in rows.items()]  # fmt: skip
        kwargs = {"slo_ttft_s": self.config.slo_ttft_s} if self.config.policy == "demand" else {}
        placement = Placement(models, budget, make_policy(self.config.policy, **kwargs),
                              drain_after_s=self.config.drain_after_s)  # fmt: skip
        self.metrics.placement_budget_bytes.set(budget)
        logger.info("placement: %d models, budget %.2f GiB, policy %s: %s", len(models), budget / 2**30,
                    self.config.policy, ", ".join(f"{m.name} {m.footprint.total / 2**30:.2f} GiB" for m in models))  # fmt: skip
        return PlacementController(placement, self.actuator, sleep_level=self.config.sleep_level,
                                   wake_timeout_s=self.config.wake_timeout_s,
                                   prewarm_interval_s=self.config.prewarm_interval_s, on_event=self._on_event)  # fmt: skip

    async def run(self) -> None:
        """Ask every model its footprint (again each second until all answer), put to sleep
        what is over the budget, then run the controller's loop."""
        while self.controller is None:
            try:
                controller = await self._start()
            except ValueError as exc:  # a budget no model fits in: stays off, shown on /health
                self.error = str(exc)
                logger.error("placement is off: %s", exc)
                return
            except ControlFailed as exc:
                if exc.status == 404:  # the model's sleep mode is off: it can never be placed
                    self.error = f"{exc} (set enable_sleep_mode on the placed models)"
                    logger.error("placement is off: %s", self.error)
                    return
                logger.info("placement: waiting for the models to answer (%s)", exc)
                await asyncio.sleep(1.0)
                continue
            except Exception as exc:  # noqa: BLE001 - Triton still loading: try again
                logger.info("placement: waiting for the models to answer (%s)", exc)
                await asyncio.sleep(1.0)
                continue
            self.controller = controller
        try:
            await self.controller.fit()
            await self.controller.run()
        finally:
            await self.controller.close()

    def _on_event(self, model: str, event: str, seconds: float) -> None:
        if event in ("wake", "prewarm"):
            self.metrics.model_wakes.labels(model, "prewarm" if event == "prewarm" else "demand").inc()
            self.metrics.model_wake_seconds.labels(model).observe(seconds)
        elif event == "sleep":
            self.metrics.model_sleeps.labels(model).inc()
            self.metrics.model_sleep_seconds.labels(model).observe(seconds)

    def export(self) -> None:
        """Set the state and bytes gauges (before a scrape)."""
        if self.controller is None:
            return
        for m in self.controller.placement.models.values():
            for state in ModelState:
                self.metrics.model_state.labels(m.name, state.value).set(1 if m.state is state else 0)
            self.metrics.model_resident_bytes.labels(m.name).set(m.footprint.total if m.holds_memory else 0)

    def snapshot(self) -> dict:
        if self.controller is None:
            return {"running": False, "error": self.error, "models": {a: "unknown" for a in self.config.models}}
        snap = self.controller.snapshot()
        return {"running": True, **snap}

    async def close(self) -> None:
        if self.controller is not None:
            with contextlib.suppress(Exception):
                await self.controller.close()
