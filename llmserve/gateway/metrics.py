"""The gateway's own Prometheus metrics, in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "llmserve_gateway_requests", "Requests answered, by alias asked for and HTTP status.",
            ["alias", "status"], registry=self.registry,
        )  # fmt: skip
        self.latency = Histogram(
            "llmserve_gateway_request_latency_seconds", "Time from request to the last byte sent.",
            ["alias"], registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )  # fmt: skip
        self.tokens = Counter(
            "llmserve_gateway_tokens", "Tokens of the answers that carried their usage, by alias, key and kind: "
            "prompt, completion, and reasoning (the thoughts, counted in completion too).",
            ["alias", "key", "kind"], registry=self.registry,
        )  # fmt: skip
        self.rejections = Counter(
            "llmserve_gateway_rejections", "Requests refused before reaching an upstream, by reason.",
            ["reason"], registry=self.registry,
        )  # fmt: skip
        self.upstream_healthy = Gauge(
            "llmserve_gateway_upstream_healthy", "1 while a replica's breaker is closed.",
            ["alias", "replica"], registry=self.registry,
        )  # fmt: skip
        self.outstanding = Gauge(
            "llmserve_gateway_upstream_outstanding", "Requests sent to a replica and not yet finished.",
            ["alias", "replica"], registry=self.registry,
        )  # fmt: skip
        self.fallbacks = Counter(
            "llmserve_gateway_fallbacks", "Requests served by an alias's fallback.",
            ["alias", "served_by"], registry=self.registry,
        )  # fmt: skip
        self.retries = Counter(
            "llmserve_gateway_retries", "Upstream attempts failed before the first byte (the next replica is tried).",
            ["alias"], registry=self.registry,
        )  # fmt: skip
        self.in_flight = Gauge(
            "llmserve_gateway_in_flight", "Requests holding an admission slot.", registry=self.registry
        )
        self.queue_waiting = Gauge(
            "llmserve_gateway_queue_waiting", "Requests waiting for an admission slot.", registry=self.registry
        )
        self.queueing_delay = Gauge(
            "llmserve_gateway_queueing_delay_seconds",
            "How long the oldest waiting request has waited.",
            registry=self.registry,
        )
        self.routing = Counter(
            "llmserve_gateway_routing", "Requests sent upstream, by how the replica was chosen.",
            ["alias", "decision"], registry=self.registry,
        )  # fmt: skip
        # kv_aware routing (gateway/kv_routing.py): the replicas' KV event streams
        self.kv_stream_live = Gauge(
            "llmserve_gateway_kv_stream_live", "1 while a replica's KV event stream is in sequence and its publisher "
            "answers (else its requests are routed by load).", ["alias", "replica"], registry=self.registry,
        )  # fmt: skip
        self.kv_blocks = Gauge(
            "llmserve_gateway_kv_blocks", "KV blocks a replica holds by its events, by medium (GPU, CPU, DISK).",
            ["alias", "replica", "medium"], registry=self.registry,
        )  # fmt: skip
        self.kv_events_bad = Counter(
            "llmserve_gateway_kv_events_bad", "KV event messages ignored as malformed.", ["replica"],
            registry=self.registry,
        )  # fmt: skip
        self.kv_gaps = Counter(
            "llmserve_gateway_kv_gaps", "Gaps in a replica's KV event sequence: filled from its replay socket, or "
            "lost (its blocks forgotten and learned again).", ["replica", "outcome"], registry=self.registry,
        )  # fmt: skip
        self.engine_state = Gauge(
            "llmserve_gateway_engine_state", "1 for the state an upstream engine is in (ok, saturated, stuck), "
            "read from its metrics.", ["alias", "replica", "state"], registry=self.registry,
        )  # fmt: skip
        self.adapter_loads = Counter(
            "llmserve_gateway_adapter_loads", "LoRA adapters loaded on demand onto a replica (routes with lora_path).",
            ["alias", "replica"], registry=self.registry,
        )  # fmt: skip
        # placement: chat models sharing one GPU (docs/placement.md)
        self.model_state = Gauge(
            "llmserve_model_state", "1 for the state a placed model is in (resident, asleep, waking, sleeping).",
            ["model", "state"], registry=self.registry,
        )  # fmt: skip
        self.model_wakes = Counter(
            "llmserve_model_wakes", "Wakes of a placed model, by why (demand: a request waited; prewarm).",
            ["model", "reason"], registry=self.registry,
        )  # fmt: skip
        self.model_sleeps = Counter(
            "llmserve_model_sleeps", "Times a placed model was put to sleep.", ["model"], registry=self.registry
        )
        self.model_wake_seconds = Histogram(
            "llmserve_model_wake_seconds", "Time one wake took.", ["model"], registry=self.registry,
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
        )  # fmt: skip
        self.model_sleep_seconds = Histogram(
            "llmserve_model_sleep_seconds", "Time one sleep took.", ["model"], registry=self.registry,
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
        )  # fmt: skip
        self.model_resident_bytes = Gauge(
            "llmserve_model_resident_bytes", "Device bytes a placed model holds now (weights and KV cache).",
            ["model"], registry=self.registry,
        )  # fmt: skip
        self.placement_budget_bytes = Gauge(
            "llmserve_placement_budget_bytes", "The GPU memory budget the placed models share.", registry=self.registry
        )
        self.wake_timeouts = Counter(
            "llmserve_model_wake_timeouts", "Requests refused (503) because their model was not awake in time.",
            ["model"], registry=self.registry,
        )  # fmt: skip
