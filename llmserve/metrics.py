"""Prometheus metrics with vLLM's names (`vllm:*`), so existing dashboards work.

Gauges and the core's cumulative counters are read from the engine at scrape time;
request-level histograms and token counters are fed by the engine's iteration stats.
Each server has its own registry: no global state.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from llmserve.engine.kv_disk_store import LoadLatency
from llmserve.engine.output_processor import IterationStats
from llmserve.engine.protocol import EngineClient

_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]  # fmt: skip
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]  # fmt: skip
_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
_LENGTH_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
FINISH_REASONS = ("stop", "length", "abort")


class _EngineStateCollector(Collector):
    """Gauges and cumulative core counters, read from the engine when scraped."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator:
        by_rank = getattr(self.engine, "stats_by_rank", None)
        ranks = by_rank() if by_rank is not None else []
        if len(ranks) <= 1:
            yield from self._families(self.engine.stats(), ["model_name"], [self.model_name])
            return
        # data parallelism: each engine core's series, labelled with its index as vLLM's `engine`
        merged: dict[str, Any] = {}
        for rank, s in enumerate(ranks):
            for family in self._families(s, ["model_name", "engine"], [self.model_name, str(rank)]):
                if family.name in merged:
                    merged[family.name].samples += family.samples
                else:
                    merged[family.name] = family
        yield from merged.values()

    def _families(self, s, labels: list[str], value: list[str]) -> Iterator:
        for name, doc, v in (
            ("vllm:num_requests_running", "Requests in the running batch.", s.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", s.kv_cache_usage),
            ("vllm:gpu_cache_usage_perc", "KV-cache usage (vLLM's older name).", s.kv_cache_usage),
            ("vllm:num_kv_blocks_used", "KV blocks held by requests.", s.num_blocks_used),
            ("vllm:num_kv_blocks_total", "KV blocks in the cache.", s.num_blocks_total),
            (
                "llmserve:kv_cache_tokens",
                "Tokens the KV cache holds (blocks x block size; an FP8 cache twice a bf16 one's).",
                s.kv_cache_tokens,
            ),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, v)
            yield g
        for name, doc, v in (
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            ("vllm:num_preemptions", "Requests preempted for lack of KV blocks.", s.num_preemptions),
            ("vllm:spec_decode_num_drafts", "Speculative verification rows (a speculating request's step).",
             s.spec_num_drafts),
            ("vllm:spec_decode_num_draft_tokens", "Tokens proposed by speculative decoding.", s.spec_num_draft_tokens),
            ("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted.", s.spec_num_accepted_tokens),
            ("llmserve:kv_offload_hit_tokens", "Prompt tokens found in the prefix cache's host tier.",
             s.kv_offload_hit_tokens),
            ("llmserve:kv_offload_stored_blocks", "KV blocks written to the host tier.", s.kv_offload_stored_blocks),
            ("llmserve:kv_offload_loaded_blocks", "KV blocks read back from the host tier.", s.kv_offload_loaded_blocks),
            ("llmserve:kv_disk_hit_tokens", "Prompt tokens found in the prefix cache's disk tier.", s.kv_disk_hit_tokens),
            ("llmserve:kv_disk_stored_blocks", "KV blocks written to the disk tier.", s.kv_disk_stored_blocks),
            ("llmserve:kv_disk_loaded_blocks", "KV blocks read back from the disk tier.", s.kv_disk_loaded_blocks),
            ("llmserve:kv_disk_errors", "Disk tier I/O errors (full disk, unwritable directory), each a recompute.",
             s.kv_disk_errors),
            ("llmserve:kv_disk_corrupt_blocks", "Disk tier blocks found torn or corrupt, ignored (recomputed).",
             s.kv_disk_corrupt_blocks),
        ):  # fmt: skip
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(value, v)
            yield c
        yield from _tier_metrics(s, labels, value)
        if s.spec_accepted_per_position:
            c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Proposed tokens accepted, by their position in the proposal.",
                                    labels=labels + ["position"])  # fmt: skip
            for position, count in enumerate(s.spec_accepted_per_position):
                c.add_metric(value + [str(position)], count)
            yield c


def _tier_metrics(s, labels: list[str], value: list[str]) -> Iterator:
    """The KV cache tiers' bytes moved and block-load latency, by tier (cpu, disk)."""
    moved = CounterMetricFamily("llmserve:kv_tier_bytes", "Bytes of KV blocks moved into (stored) and out of "
                                "(loaded) each tier of the prefix cache.", labels=labels + ["tier", "direction"])  # fmt: skip
    for tier, stored, loaded in (("cpu", s.kv_offload_stored_blocks, s.kv_offload_loaded_blocks),
                                 ("disk", s.kv_disk_stored_blocks, s.kv_disk_loaded_blocks)):  # fmt: skip
        moved.add_metric(value + [tier, "stored"], stored * s.kv_offload_block_bytes)
        moved.add_metric(value + [tier, "loaded"], loaded * s.kv_offload_block_bytes)
    yield moved
    latency = HistogramMetricFamily("llmserve:kv_tier_load_seconds", "Time to load one KV block from a tier "
                                    "(disk: read and checked; cpu: its share of a step's copy).", labels=labels + ["tier"])  # fmt: skip
    for tier, seconds in (("cpu", s.kv_offload_load_seconds), ("disk", s.kv_disk_load_seconds)):
        if seconds:
            counts, total = seconds
            latency.add_metric(value + [tier], LoadLatency(list(counts), total).buckets(), total)
    yield latency


class EngineMetrics:
    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        reg = self.registry
        label = ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", label, registry=reg)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", label, registry=reg)
        self.request_success = Counter(
            "vllm:request_success", "Finished requests.", label + ["finished_reason"], registry=reg
        )

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, label, buckets=buckets, registry=reg)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between generated tokens.", _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS)
        self.queue_time = histogram(  # vLLM's split: queue and prefill are the engine core's view
            "vllm:request_queue_time_seconds",
            "Time in the engine core's queue before first scheduled.",
            _LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "From first scheduled to the engine core's first token.",
            _LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds", "From the first token to the last.", _LATENCY_BUCKETS
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds", "From first scheduled to the last token.", _LATENCY_BUCKETS
        )
        self.prompt_len = histogram(
            "vllm:request_prompt_tokens", "Prompt length of finished requests.", _LENGTH_BUCKETS
        )
        self.generation_len = histogram(
            "vllm:request_generation_tokens", "Generated length of finished requests.", _LENGTH_BUCKETS
        )
        # children exist from the start, so every series reads 0 before the first request
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        for metric in (
            self.prompt_tokens,
            self.generation_tokens,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue_time,
            self.prefill_time,
            self.decode_time,
            self.inference_time,
            self.prompt_len,
            self.generation_len,
        ):
            metric.labels(model_name)
        reg.register(_EngineStateCollector(engine, model_name))
        engine.add_stats_listener(self.observe)

    def page(self) -> str:
        """The Prometheus text page of this registry."""
        return generate_latest(self.registry).decode()

    def observe(self, it: IterationStats) -> None:
        name = self.model_name
        if it.num_prompt_tokens:
            self.prompt_tokens.labels(name).inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens.labels(name).inc(it.num_generation_tokens)
        for v in it.time_to_first_tokens:
            self.ttft.labels(name).observe(v)
        for v in it.inter_token_latencies:
            self.itl.labels(name).observe(v)
        for f in it.finished:
            self.request_success.labels(name, f.finish_reason).inc()
            self.e2e.labels(name).observe(f.e2e_latency)
            self.queue_time.labels(name).observe(f.queue_time)
            self.prefill_time.labels(name).observe(f.prefill_time)
            self.decode_time.labels(name).observe(f.decode_time)
            self.inference_time.labels(name).observe(f.prefill_time + f.decode_time)
            self.prompt_len.labels(name).observe(f.num_prompt_tokens)
            self.generation_len.labels(name).observe(f.num_generation_tokens)
