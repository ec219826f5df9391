"""The status page's arithmetic: parsing an upstream's /metrics and the numbers over a span."""

from __future__ import annotations

import pytest

from llmserve.gateway.dashboard import Sample, parse_metrics, span_point

pytestmark = pytest.mark.unit

PAGE = """# HELP vllm:num_requests_running Requests in the running batch.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
vllm:num_requests_waiting{model_name="m"} 2.0
vllm:kv_cache_usage_perc{model_name="m"} 0.25
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="m"} 1000.0
vllm:generation_tokens_created{model_name="m"} 1.7e9
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 10.0
vllm:time_to_first_token_seconds_count{model_name="m"} 10.0
vllm:time_to_first_token_seconds_sum{model_name="m"} 0.5
vllm:e2e_request_latency_seconds_count{model_name="m"} 4.0
vllm:e2e_request_latency_seconds_sum{model_name="m"} 8.0
"""


def test_parse_metrics_reads_the_vllm_names():
    s = parse_metrics(PAGE)
    assert s.model == "m"
    assert s.values == {"running": 3.0, "waiting": 2.0, "kv_usage": 0.25, "generation_tokens": 1000.0,
                        "ttft_count": 10.0, "ttft_sum": 0.5, "e2e_count": 4.0, "e2e_sum": 8.0}  # fmt: skip


def test_span_point_rates_and_mean_latencies():
    a = Sample(
        100.0, {"generation_tokens": 1000.0, "ttft_sum": 0.5, "ttft_count": 10.0, "e2e_sum": 8.0, "e2e_count": 4.0}
    )
    b = Sample(102.0, {"generation_tokens": 1300.0, "ttft_sum": 0.8, "ttft_count": 12.0, "e2e_sum": 8.0,
                       "e2e_count": 4.0, "running": 5.0, "waiting": 1.0, "kv_usage": 0.5})  # fmt: skip
    p = span_point(a, b)
    assert p.tokens_per_s == 150.0  # 300 tokens in 2 s
    assert p.ttft_ms == 150.0  # 0.3 s over 2 new first tokens
    assert p.e2e_ms is None  # nothing finished in the span
    assert (p.running, p.waiting, p.kv_usage) == (5.0, 1.0, 0.5)


def test_span_point_after_a_restart_or_a_failed_scrape():
    before = Sample(100.0, {"generation_tokens": 5000.0})
    restarted = Sample(101.0, {"generation_tokens": 20.0})  # counters start again at 0
    assert span_point(before, restarted).tokens_per_s is None
    failed = Sample(102.0, {})
    p = span_point(restarted, failed)
    assert p.tokens_per_s is None and p.running is None


def test_sampler_over_unreachable_and_triton_upstreams():
    """A down HTTP replica is sampled as empty; so is a Triton model that does not answer (over
    gRPC or HTTP), which has no metrics until it does; neither stops the sampler."""
    import asyncio

    import httpx
    from server_utils import free_port

    from llmserve.gateway.config import GatewayConfig
    from llmserve.gateway.gateway import Gateway

    down = f"http://127.0.0.1:{free_port()}"
    config = GatewayConfig.model_validate({"models": {
        "chat": {"replicas": [down]},
        "embed": {"kind": "triton", "replicas": [f"grpc://127.0.0.1:{free_port()}"]},
        "rerank": {"kind": "triton", "replicas": [f"http://127.0.0.1:{free_port()}"]},
    }})  # fmt: skip
    sampler = Gateway(config).sampler

    async def sample_twice() -> None:
        async with httpx.AsyncClient(timeout=1.0) as client:
            await sampler.sample_once(client)
            await sampler.sample_once(client)

    asyncio.run(sample_twice())
    data = sampler.data()
    by_url = {u.url: u for u in data.upstreams}
    assert not by_url[down].scraped and by_url[down].has_metrics and by_url[down].latest.tokens_per_s is None
    tritons = [u for u in data.upstreams if u.url != down]
    assert len(tritons) == 2 and all(not u.has_metrics and not u.scraped for u in tritons)
    assert all(p.running is None for u in tritons for p in u.series)
    assert sampler.engine_states() == {}  # nothing answered: no state to tell
    assert sampler.scraped_urls == [down]
    assert [m.alias for m in data.models] == ["chat", "embed", "rerank"]
