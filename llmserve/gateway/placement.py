"""Several chat models sharing one GPU, driven from the gateway (docs/placement.md): Triton
chat models, or `llmserve serve --enable-sleep-mode` servers.

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
from llmserve.gateway.triton_upstream import TritonClients
from llmserve.placement.controller import PlacementController, WakeTimeout
from llmserve.placement.engine_control import FOOTPRINT, SLEEP, WAKE_UP
from llmserve.placement.footprint import Footprint, parse_budget
from llmserve.placement.model_state import ModelState, PlacedModel
from llmserve.placement.placement import Placement
from llmserve.placement.policies import make_policy

logger = logging.getLogger("llmserve.gateway.placement")

__all__ = ["GatewayPlacement", "HttpActuator", "TritonActuator", "WakeTimeout"]


class ControlFailed(Exception):
    """A control call got an answer other than the one expected."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class _ControlActuator:
    """Sleep, wake and footprint over a model server's control calls; a subclass says how a
    call travels (`call`: the status and the JSON answer)."""

    async def call(self, name: str, endpoint: str, body: dict | None = None) -> tuple[int, dict]:
        raise NotImplementedError

    async def _call_checked(self, name: str, endpoint: str, body: dict | None = None) -> tuple[int, dict]:
        status, answer = await self.call(name, endpoint, body)
        if status not in (200, 409):
            raise ControlFailed(f"{name}: {endpoint} answered {status}: {answer}", status)
        return status, answer

    async def sleep(self, name: str, level: int) -> bool:
        status, answer = await self._call_checked(name, SLEEP, {"level": level})
        return status == 200  # 409: it had work after all

    async def wake(self, name: str) -> None:
        status, answer = await self._call_checked(name, WAKE_UP)
        if status != 200:
            raise ControlFailed(f"{name}: {WAKE_UP} answered {status}: {answer}", status)

    async def footprint(self, name: str) -> dict:
        status, answer = await self._call_checked(name, FOOTPRINT)
        if status != 200:
            raise ControlFailed(f"{name}: {FOOTPRINT} answered {status}: {answer}", status)
        return answer


class TritonActuator(_ControlActuator):
    """Triton chat models (alias -> replica address and model name): the control calls as the
    chat model's `endpoint` input, over the connection requests use (gRPC or HTTP)."""

    def __init__(self, clients: TritonClients, targets: dict[str, tuple[str, str]], timeout_s: float = 600.0):
        self.clients = clients
        self.targets = targets
        self.timeout_s = timeout_s

    async def call(self, name: str, endpoint: str, body: dict | None = None) -> tuple[int, dict]:
        url, model = self.targets[name]
        answers = [a async for a in self.clients.events(url, model, json.dumps(body or {}), endpoint,
                                                        self.timeout_s)]  # fmt: skip
        if not answers:
            raise ControlFailed(f"{name}: {endpoint} got no answer")
        status, text = answers[-1]
        try:
            return status, json.loads(text)
        except ValueError:
            raise ControlFailed(f"{name}: {endpoint} answered {status} with no JSON: {text[:200]!r}", status) from None


class HttpActuator(_ControlActuator):
    """`llmserve serve --enable-sleep-mode` servers (alias -> base URL), with their sleep-mode
    routes: POST /sleep?level=, POST /wake_up, GET /footprint."""

    def __init__(self, targets: dict[str, str], timeout_s: float = 600.0,
                 headers: dict[str, dict[str, str]] | None = None) -> None:  # fmt: skip
        self.targets = targets
        self.timeout_s = timeout_s
        self.headers = headers or {}  # alias -> the control calls' headers (an admin key)
        self._client = None

    def _http(self):
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=2.0))
        return self._client

    async def call(self, name: str, endpoint: str, body: dict | None = None) -> tuple[int, dict]:
        import httpx

        method, path = ("GET", endpoint) if endpoint == FOOTPRINT else ("POST", endpoint)
        if endpoint == SLEEP:
            path += f"?level={(body or {}).get('level', 1)}"
        try:
            resp = await self._http().request(method, self.targets[name] + path, headers=self.headers.get(name))
            return resp.status_code, resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise ControlFailed(f"{name}: {method} {path} failed: {type(exc).__name__}: {exc}") from None

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()


class RouteActuator:
    """Each placed alias driven by the actuator of its upstream's kind (Triton or llmserve serve)."""

    def __init__(self, by_alias: dict[str, TritonActuator | HttpActuator]) -> None:
        self.by_alias = by_alias

    async def sleep(self, name: str, level: int) -> bool:
        return await self.by_alias[name].sleep(name, level)

    async def wake(self, name: str) -> None:
        await self.by_alias[name].wake(name)

    async def footprint(self, name: str) -> dict:
        return await self.by_alias[name].footprint(name)


class GatewayPlacement:
    def __init__(self, config: PlacementConfig, gateway: GatewayConfig, clients: TritonClients,
                 metrics: GatewayMetrics) -> None:  # fmt: skip
        self.config = config
        self.metrics = metrics
        routes = {a: gateway.models[a] for a in config.models}
        triton = TritonActuator(clients, {a: (r.replicas[0], r.model or a) for a, r in routes.items() if r.kind == "triton"},
                                gateway.upstream_timeout_s)  # fmt: skip
        openai_routes = {a: r for a, r in routes.items() if r.kind == "openai"}
        self.http = HttpActuator({a: r.replicas[0] for a, r in openai_routes.items()}, gateway.upstream_timeout_s,
                                 {a: r.control_headers() for a, r in openai_routes.items()})  # fmt: skip
        self.actuator = RouteActuator({a: triton if r.kind == "triton" else self.http for a, r in routes.items()})
        self.controller: PlacementController | None = None  # once every model answered its footprint
        self.error: str | None = None  # why the controller could not start (a budget too small)

    def manages(self, alias: str) -> bool:
        return alias in self.actuator.by_alias

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
        models = [PlacedModel(a, Footprint.from_row(r),
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

    async def backend_restarted(self, alias: str) -> None:
        """The model's backend was restarted (its stub died; `llmserve up`'s watchdog): it came
        back awake. If placement holds it asleep, it goes back to sleep, so the device holds
        what placement counts; a resident one is as placement thinks."""
        if self.held_asleep(alias):
            logger.info("placement: %s restarted awake while placed asleep: putting it to sleep again", alias)
            try:
                await self.actuator.sleep(alias, self.config.sleep_level)
            except Exception as exc:  # noqa: BLE001 - logged; the next wake or sleep sets it right
                logger.warning("placement: %s could not be put to sleep after its restart: %s", alias, exc)

    def held_asleep(self, alias: str) -> bool | None:
        """Whether placement holds `alias` asleep now (None before it runs)."""
        if self.controller is None or alias not in self.controller.placement.models:
            return None
        return self.controller.placement.models[alias].state in (ModelState.ASLEEP, ModelState.SLEEPING)

    def aliases_of(self, url: str, model: str) -> list[str]:
        """The placed aliases served by Triton model `model` on `url`."""
        triton = self.actuator.by_alias
        return [
            a for a, act in triton.items() if isinstance(act, TritonActuator) and act.targets.get(a) == (url, model)
        ]

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
        await self.http.close()
