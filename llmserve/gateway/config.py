"""The gateway's YAML config, typed and checked when the gateway starts."""

from __future__ import annotations

import hashlib
import os
import re
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmserve.http_protocol import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
    HttpLimits,
)
from llmserve.responses.storage import location_problem

_ALIAS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


def hash_key(key: str) -> str:
    """How a key is stored in the config: its sha256 in hex."""
    return hashlib.sha256(key.encode()).hexdigest()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KVEventsSource(_Strict):
    """Where one replica publishes its KV events (its `--kv-events-config`, as this host reaches it)."""

    endpoint: str  # the PUB socket, e.g. tcp://10.0.0.5:5557
    replay_endpoint: str | None = None  # the replay ROUTER (gaps filled, liveness probed), e.g. tcp://10.0.0.5:5558
    topic: str = ""

    @model_validator(mode="after")
    def _check(self) -> KVEventsSource:
        for name, value in (("endpoint", self.endpoint), ("replay_endpoint", self.replay_endpoint)):
            if value is not None and (not value.startswith(("tcp://", "ipc://")) or "*" in value):
                raise ValueError(f"kv_events: {name} {value!r} must be an address to connect to (tcp://host:port "
                                 "or ipc://path), not a bind pattern")  # fmt: skip
        return self


class KVRoutingConfig(_Strict):
    """`routing: kv_aware`: the replicas' KV events (which blocks each holds, in which medium)
    and how a request's cached prefix is weighed against a replica's load (docs/gateway.md)."""

    replicas: dict[str, KVEventsSource] = Field(min_length=1)  # replica URL -> its event stream
    # the model's tokenizer (a folder or GGUF file on this host), for prompts sent as text; unset:
    # the folder the replicas name as their model's `root` in /v1/models, if this host has it
    tokenizer: str | None = None
    block_size: int | None = Field(default=None, ge=1)  # unset: learned from the replicas' BlockStored events
    # what a prompt token cached in a medium saves against recomputing it (1: all of it)
    tier_weights: dict[str, float] = {"GPU": 1.0, "CPU": 0.75, "DISK": 0.5}
    # a request in flight on a replica counts against it as this many uncached prompt tokens
    load_weight_tokens: float = Field(default=256.0, ge=0)
    # a prompt routed to a replica counts as cached there for this long, until its events tell
    # (requests sharing its prefix that arrive during its prefill follow it)
    expect_s: float = Field(default=30.0, ge=0)
    probe_interval_s: float = Field(default=1.0, gt=0)  # how often the replay socket is asked for news
    probe_timeout_s: float = Field(default=2.0, gt=0)  # no answer by then: the stream is stale

    @model_validator(mode="after")
    def _check(self) -> KVRoutingConfig:
        self.replicas = {url.rstrip("/"): source for url, source in self.replicas.items()}
        if not self.tier_weights or any(not 0 <= w <= 1 for w in self.tier_weights.values()):
            raise ValueError("kv_events: tier_weights must name mediums with weights in [0, 1]")
        return self


class ModelRoute(_Strict):
    """One alias clients name, and the replicas that serve it."""

    kind: Literal["openai", "triton"] = "openai"  # an OpenAI-compatible server, or Triton (gRPC or HTTP)
    # http(s)://host:port (openai); triton: grpc://host:port (its gRPC port) or http://host:port (its HTTP port)
    replicas: list[str] = Field(min_length=1)
    model: str | None = None  # the name the upstreams know; the alias when unset
    lora: str | None = (
        None  # a LoRA adapter the upstream serves: sent as the body's model (to Triton: model stays its chat model)
    )
    # the adapter's folder as the replicas see it: the gateway prefers replicas holding `lora` and
    # loads it on demand onto the one it picks (POST /v1/load_lora_adapter with the admin key)
    lora_path: str | None = None
    fallback: str | None = None  # alias used while no replica of this one can take a request
    max_concurrency: int | None = Field(default=None, ge=1)  # per replica; above it counts as overloaded
    # kv_aware: by each replica's cached prefix of the prompt (its KV events, `kv_events`) and its load
    routing: Literal["least_outstanding", "prefix_affinity", "kv_aware"] = "least_outstanding"
    kv_events: KVRoutingConfig | None = None  # the replicas' KV event streams (routing kv_aware)
    affinity_prefix_chars: int = Field(default=256, ge=1)  # prompt prefix hashed for prefix_affinity
    affinity_max_imbalance: int = Field(default=4, ge=0)  # outstanding over the least before leaving the home
    send_priority: bool = True  # pass the key's priority upstream (vLLM-style `priority`, lower first)
    # the environment variable holding the admin key of `llmserve serve --admin-api-key` replicas,
    # sent on placement's control calls (sleep, wake, footprint); the key itself never sits in the file
    admin_api_key_env: str | None = None

    def control_headers(self) -> dict[str, str]:
        """The headers of placement's control calls to this route's replicas."""
        if self.admin_api_key_env is None:
            return {}
        key = os.environ.get(self.admin_api_key_env)
        if not key:
            raise ValueError(f"admin_api_key_env names {self.admin_api_key_env!r}, which is not set")
        return {"Authorization": f"Bearer {key}"}

    @model_validator(mode="after")
    def _urls(self) -> ModelRoute:
        schemes = ("grpc://", "http://", "https://") if self.kind == "triton" else ("http://", "https://")
        for url in self.replicas:
            if not url.startswith(schemes):
                raise ValueError(f"replica {url!r} of a {self.kind} upstream must start with {' or '.join(schemes)}")
        self.replicas = [u.rstrip("/") for u in self.replicas]
        if self.routing == "kv_aware" and self.kv_events is None:
            raise ValueError("routing kv_aware needs kv_events: the replicas' KV event endpoints")
        if self.kv_events is not None and (unknown := sorted(set(self.kv_events.replicas) - set(self.replicas))):
            raise ValueError(f"kv_events names replicas this route does not have: {', '.join(unknown)}")
        if self.lora_path is not None and (self.lora is None or self.kind != "openai"):
            raise ValueError("lora_path (loading an adapter on demand) needs `lora` and llmserve serve replicas "
                             "(kind: openai); a Triton chat model takes its adapters from lora_modules")  # fmt: skip
        return self


class ApiKey(_Strict):
    name: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    models: list[str] = ["*"]  # aliases this key may call; "*" is all
    priority: int = 0  # larger is more important: admission order, shedding, and the engine's priority
    rpm: int | None = Field(default=None, ge=1)  # requests per minute
    tpm: int | None = Field(default=None, ge=1)  # tokens per minute (prompt estimate + max_tokens)
    revoked: bool = False


class HealthConfig(_Strict):
    interval_s: float = Field(default=1.0, gt=0)
    timeout_s: float = Field(default=1.0, gt=0)
    failure_threshold: int = Field(default=2, ge=1)  # consecutive failures that open the breaker


class LimitsConfig(_Strict):
    """Where the token buckets live: this process's memory, or a Redis shared by several gateways."""

    backend: Literal["memory", "redis"] = "memory"
    url: str | None = None  # redis://host:port/db (backend redis)
    prefix: str = "llmserve:limits"  # Redis key prefix: gateways sharing limits use the same one
    timeout_s: float = Field(default=0.5, gt=0)
    fail_open: bool = False  # Redis unreachable: let requests through (true) or refuse them with 503

    @model_validator(mode="after")
    def _check(self) -> LimitsConfig:
        if self.backend == "redis" and not (self.url or "").startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("limits: backend redis needs a url like redis://127.0.0.1:6379/0")
        return self


class AdmissionConfig(_Strict):
    """A global concurrency cap with a priority-ordered wait, and shedding by queueing delay."""

    max_concurrency: int | None = Field(default=None, ge=1)  # requests in flight at once, all aliases
    queue_timeout_s: float = Field(default=5.0, gt=0)  # longest wait for a slot, then 503 queue_timeout
    max_queue: int = Field(default=1000, ge=0)  # more waiting than this: 503 queue_full at once
    target_queue_delay_ms: float | None = Field(default=None, gt=0)  # above it, shed lowest priority first


class PlacementConfig(_Strict):
    """Chat models sharing one GPU within a memory budget (docs/placement.md): the gateway
    wakes a model for its requests, puts idle ones to sleep to make room, and pre-warms."""

    gpu_memory_budget: int | float | str  # bytes, a fraction or percentage of the device, or "40GiB"
    models: list[str] = Field(
        min_length=1
    )  # aliases, one replica each: Triton chat models or llmserve servers, sleep mode on
    policy: str = "demand"  # lru | lru_prewarm | q_learning | demand (llmserve bench placement)
    sleep_level: Literal[1, 2] = 1  # 1: weights kept in host memory; 2: read again on wake
    wake_timeout_s: float = Field(default=60.0, gt=0)  # a request waits this long for a wake, then 503
    slo_ttft_s: float = Field(default=2.0, gt=0)  # the TTFT target the demand policy protects
    prewarm_interval_s: float = Field(default=1.0, gt=0)  # how often pre-warms are considered
    # a request waiting this long for a wake with no idle model to make room drains busy ones
    # (their new requests wait until they slept and woke again); null: never
    drain_after_s: float | None = Field(default=5.0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> PlacementConfig:
        from llmserve.placement.footprint import parse_budget
        from llmserve.placement.policies import POLICIES

        if self.policy not in POLICIES:
            raise ValueError(f"placement policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        parse_budget(self.gpu_memory_budget, device_total=1 << 40)  # its form; the size is checked at start
        if len(set(self.models)) != len(self.models):
            raise ValueError("placement: models are listed twice")
        return self


class ExposureConfig(_Strict):
    """Who may read the gateway's own pages: `open` (anyone who reaches the port), `keyed` (a
    valid gateway key, as for the API: Prometheus sends it with `authorization`), `off` (404)."""

    metrics: Literal["open", "keyed", "off"] = "open"  # /metrics
    dashboard: Literal["open", "keyed", "off"] = "open"  # /dashboard and /dashboard/data


class ResponsesConfig(_Strict):
    """The gateway's Responses API (llmserve/gateway/responses.py): where its stored responses
    live (an SQLite file; ":memory:" keeps them in memory only; a Postgres URL, postgresql://...;
    default $XDG_CACHE_HOME/llmserve/gateway-responses.sqlite) and how many, how old (0: no limit)."""

    store: str | None = None
    max_count: int = Field(default=10_000, ge=0)
    max_age_days: float = Field(default=30.0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> ResponsesConfig:
        if (problem := location_problem(self.store)) is not None:
            raise ValueError(f"responses: store: {problem}")
        return self


class GatewayConfig(_Strict):
    models: dict[str, ModelRoute] = Field(min_length=1)
    keys: list[ApiKey] = []  # no keys: the gateway is open
    health: HealthConfig = HealthConfig()
    limits: LimitsConfig = LimitsConfig()
    admission: AdmissionConfig = AdmissionConfig()
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    max_header_bytes: int = Field(default=64 << 10, ge=1024)  # request line and headers: 431 above
    # a body not received whole by then is refused (408); nor may any gap in it be longer
    body_timeout_s: float = Field(default=DEFAULT_BODY_TIMEOUT_S, gt=0)
    header_timeout_s: float = Field(default=DEFAULT_HEADER_TIMEOUT_S, gt=0)  # a head not whole by then: 408
    # connections held at once, in all (kept to half the open-file limit) and from one address (0: no
    # cap): over a cap the one waiting longest for its request is closed, or the new one refused
    max_connections: int = Field(default=DEFAULT_MAX_CONNECTIONS, ge=1)
    max_connections_per_client: int = Field(default=DEFAULT_MAX_CONNECTIONS_PER_CLIENT, ge=0)
    upstream_timeout_s: float = Field(default=600.0, gt=0)
    # the longest a chat or completions request to a Triton chat model may run: sent to the model
    # as the request's `request_timeout_s` (a client's shorter one kept), which stops it there (504,
    # or a stream's last error event); None: no cap beyond the client's own
    request_timeout_s: float | None = Field(default=600.0, gt=0)
    # health: an engine with requests running and no token made for this long is `stuck`, one whose
    # requests have waited in its queue for this long `saturated` (GET /health, the metrics)
    engine_stuck_after_s: float = Field(default=30.0, gt=0)
    engine_saturated_after_s: float = Field(default=5.0, gt=0)
    # a request no replica (nor fallback) could start because they are unreachable or their
    # backend is down waits this long for one to come back (a restarting backend), retried
    # with backoff; then it fails (502/503). 0: fail at once. Busy replicas (503) never wait.
    retry_unstarted_s: float = Field(default=60.0, ge=0)
    default_max_tokens: int = Field(default=256, ge=1)  # reserved when a request names none
    placement: PlacementConfig | None = None  # several chat models on one GPU, woken on demand
    expose: ExposureConfig = ExposureConfig()  # the metrics and the status page: open, keyed or off
    responses: ResponsesConfig = ResponsesConfig()  # /v1/responses over the chat routes, stored per key

    def http_limits(self) -> HttpLimits:
        return HttpLimits(self.max_header_bytes, self.header_timeout_s, self.body_timeout_s, self.max_connections,
                          self.max_connections_per_client)  # fmt: skip

    @model_validator(mode="after")
    def _check(self) -> GatewayConfig:
        if not self.keys and "keyed" in (self.expose.metrics, self.expose.dashboard):
            raise ValueError("expose: `keyed` needs keys (an open gateway has none to check)")
        for alias, route in self.models.items():
            if not _ALIAS.match(alias):
                raise ValueError(f"model alias {alias!r} has characters outside [A-Za-z0-9._:/-]")
            if route.fallback is not None and route.fallback not in self.models:
                raise ValueError(f"alias {alias!r}: fallback {route.fallback!r} is not a configured alias")
            if route.fallback == alias:
                raise ValueError(f"alias {alias!r} names itself as fallback")
        if self.placement is not None:
            placed = set(self.placement.models)
            for alias in placed:
                route = self.models.get(alias)
                if route is None or len(route.replicas) != 1:
                    raise ValueError(
                        f"placement: {alias!r} must be an alias with one replica (a Triton chat model, "
                        "or an `llmserve serve --enable-sleep-mode` server)"
                    )
            for alias, route in self.models.items():  # a request is held for the model that serves it
                if route.fallback is not None and (alias in placed or route.fallback in placed):
                    raise ValueError(
                        f"alias {alias!r}: a fallback to or from a placed model is not supported "
                        "(the placement holds requests for the alias they name)"
                    )
        names = [k.name for k in self.keys]
        if len(set(names)) != len(names):
            raise ValueError("key names must be unique")
        for key in self.keys:
            unknown = [m for m in key.models if m != "*" and m not in self.models]
            if unknown:
                raise ValueError(f"key {key.name!r} allows unknown aliases {unknown}")
        return self


def load_config(path: str) -> GatewayConfig:
    with open(path) as f:
        return GatewayConfig.model_validate(yaml.safe_load(f) or {})
