"""Write the Grafana dashboards in deploy/grafana/dashboards/ from the panel lists below.

    python deploy/grafana/build_dashboards.py

Edit the panels here, not the JSON: tests/test_deploy_files.py checks that the JSON is what
this script writes, and tests/test_deploy_live.py that every query names a metric that a
running server, gateway and Triton export.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
ENGINE = 'job=~"$job", model_name=~"$model"'


@dataclass
class Panel:
    title: str
    queries: list[tuple[str, str]]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    description: str = ""
    max: float | None = None
    extra: dict = field(default_factory=dict)


def quantiles(metric: str, labels: str, by: str = "model_name") -> list[tuple[str, str]]:
    return [
        (f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{labels}}}[{RATE}])))",
         f"p{int(q * 100)} {{{{{by}}}}}")
        for q in (0.5, 0.9, 0.99)
    ]  # fmt: skip


def mean_per(numerator: str, denominator: str, labels: str, by: str) -> str:
    return (f"sum by ({by}) (rate({numerator}{{{labels}}}[{RATE}]))"
            f" / sum by ({by}) (rate({denominator}{{{labels}}}[{RATE}]))")  # fmt: skip


ENGINE_PANELS = [
    Panel("Requests finished / s", [
        (f"sum by (model_name, finished_reason) (rate(vllm:request_success_total{{{ENGINE}}}[{RATE}]))",
         "{{model_name}} {{finished_reason}}")], "reqps"),
    Panel("Queue depth: running and waiting requests", [
        (f"sum by (model_name) (vllm:num_requests_running{{{ENGINE}}})", "running {{model_name}}"),
        (f"sum by (model_name) (vllm:num_requests_waiting{{{ENGINE}}})", "waiting {{model_name}}")]),
    Panel("Tokens / s", [
        (f"sum by (model_name) (rate(vllm:generation_tokens_total{{{ENGINE}}}[{RATE}]))", "output {{model_name}}"),
        (f"sum by (model_name) (rate(vllm:prompt_tokens_total{{{ENGINE}}}[{RATE}]))", "prompt {{model_name}}")]),
    Panel("KV-cache usage", [
        (f"max by (instance, model_name) (vllm:kv_cache_usage_perc{{{ENGINE}}})", "{{instance}} {{model_name}}")],
        "percentunit", max=1, description="Alert LLMServeKVCacheNearlyFull fires above 85 % for 3 minutes."),
    Panel("Time to first token (TTFT)", quantiles("vllm:time_to_first_token_seconds", ENGINE), "s"),
    Panel("Time per output token (TPOT: inter-token latency)",
          quantiles("vllm:inter_token_latency_seconds", ENGINE), "s"),
    Panel("End-to-end request latency", quantiles("vllm:e2e_request_latency_seconds", ENGINE), "s"),
    Panel("Queue time (before first scheduled)", quantiles("vllm:request_queue_time_seconds", ENGINE), "s"),
    Panel("Prefill time (first scheduled to first token)", quantiles("vllm:request_prefill_time_seconds", ENGINE), "s",
          description="With queue time, where TTFT goes: waiting for a slot, or computing the prompt."),
    Panel("Prefix-cache hit rate", [
        (mean_per("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", ENGINE, "model_name"),
         "{{model_name}}")], "percentunit", max=1,
        description="Prompt tokens found in the prefix cache / prompt tokens looked up."),
    Panel("Preemptions / s", [
        (f"sum by (model_name) (rate(vllm:num_preemptions_total{{{ENGINE}}}[{RATE}]))", "{{model_name}}")]),
    Panel("Mean prompt and output length (tokens)", [
        (mean_per("vllm:request_prompt_tokens_sum", "vllm:request_prompt_tokens_count", ENGINE, "model_name"),
         "prompt {{model_name}}"),
        (mean_per("vllm:request_generation_tokens_sum", "vllm:request_generation_tokens_count", ENGINE, "model_name"),
         "output {{model_name}}")]),
    Panel("KV blocks in use", [
        (f"sum by (instance) (vllm:num_kv_blocks_used{{{ENGINE}}})", "{{instance}}")]),
]  # fmt: skip

GATEWAY = 'job=~"$job"'
GATEWAY_PANELS = [
    Panel("Requests / s by alias and status", [
        (f"sum by (alias, status) (rate(llmserve_gateway_requests_total{{{GATEWAY}}}[{RATE}]))",
         "{{alias}} {{status}}")], "reqps"),
    Panel("Rejections / s by reason", [
        (f"sum by (reason) (rate(llmserve_gateway_rejections_total{{{GATEWAY}}}[{RATE}]))", "{{reason}}")], "reqps",
        description="Refused before reaching an upstream: keys, limits, body size, no healthy upstream, ..."),
    Panel("Latency to the last byte", quantiles("llmserve_gateway_request_latency_seconds", GATEWAY, "alias"), "s"),
    Panel("Error ratio (5xx)", [
        ((f'sum by (alias) (rate(llmserve_gateway_requests_total{{{GATEWAY}, status=~"5.."}}[{RATE}]))'
          f" / sum by (alias) (rate(llmserve_gateway_requests_total{{{GATEWAY}}}[{RATE}]))"), "{{alias}}")],
        "percentunit"),
    Panel("Healthy replicas", [
        (f"sum by (alias) (llmserve_gateway_upstream_healthy{{{GATEWAY}}})", "{{alias}}")]),
    Panel("Outstanding requests per replica", [
        (f"llmserve_gateway_upstream_outstanding{{{GATEWAY}}}", "{{alias}} {{replica}}")]),
    Panel("Fallbacks and retries / s", [
        (f"sum by (alias, served_by) (rate(llmserve_gateway_fallbacks_total{{{GATEWAY}}}[{RATE}]))",
         "fallback {{alias}} -> {{served_by}}"),
        (f"sum by (alias) (rate(llmserve_gateway_retries_total{{{GATEWAY}}}[{RATE}]))", "retry {{alias}}")], "reqps"),
    # placement: several models sharing one GPU (docs/placement.md); empty without a `placement:` section
    Panel("Placed models by state", [
        (f"sum by (state) (llmserve_model_state{{{GATEWAY}}})", "{{state}}")],
        description="How many placed models are resident, asleep, waking or going to sleep."),
    Panel("Placed models: device memory against the budget", [
        (f"sum(llmserve_model_resident_bytes{{{GATEWAY}}})", "resident"),
        (f"max(llmserve_placement_budget_bytes{{{GATEWAY}}})", "budget"),
        (f"llmserve_model_resident_bytes{{{GATEWAY}}}", "{{model}}")], "bytes"),
    Panel("Wakes and sleeps / s", [
        (f"sum by (model, reason) (rate(llmserve_model_wakes_total{{{GATEWAY}}}[{RATE}]))", "wake {{model}} ({{reason}})"),
        (f"sum by (model) (rate(llmserve_model_sleeps_total{{{GATEWAY}}}[{RATE}]))", "sleep {{model}}")], "ops"),
    Panel("Wake time", quantiles("llmserve_model_wake_seconds", GATEWAY, "model"), "s",
          description="A level-1 wake of an 8B model took 0.34-0.43 s on an H200 (docs/history/benchmarks.md)."),
    Panel("Requests refused while their model woke / s", [
        (f"sum by (model) (rate(llmserve_model_wake_timeouts_total{{{GATEWAY}}}[{RATE}]))", "{{model}}")], "reqps",
        description="503 model_waking after wake_timeout_s. Alert LLMServeModelWakeTimeouts fires when it lasts 5 minutes."),
]  # fmt: skip

TRITON = 'job=~"$job", model=~"$model"'
TRITON_PANELS = [
    Panel("Requests / s per model", [
        (f"sum by (model) (rate(nv_inference_request_success{{{TRITON}}}[{RATE}]))", "ok {{model}}"),
        (f"sum by (model) (rate(nv_inference_request_failure{{{TRITON}}}[{RATE}]))", "failed {{model}}")], "reqps"),
    Panel("Inferences and executions / s per model", [
        (f"sum by (model) (rate(nv_inference_count{{{TRITON}}}[{RATE}]))", "inferences {{model}}"),
        (f"sum by (model) (rate(nv_inference_exec_count{{{TRITON}}}[{RATE}]))", "executions {{model}}")],
        description="Inferences per execution is the mean dynamic batch size."),
    Panel("Mean batch size", [
        (mean_per("nv_inference_count", "nv_inference_exec_count", TRITON, "model"), "{{model}}")]),
    Panel("Mean queue time per request", [
        (mean_per("nv_inference_queue_duration_us", "nv_inference_request_success", TRITON, "model"), "{{model}}")],
        "µs", description="Alert TritonQueueDurationGrowing watches this."),
    Panel("Mean compute and request time", [
        (mean_per("nv_inference_compute_infer_duration_us", "nv_inference_request_success", TRITON, "model"),
         "compute {{model}}"),
        (mean_per("nv_inference_request_duration_us", "nv_inference_request_success", TRITON, "model"),
         "request {{model}}")], "µs"),
    Panel("Pending requests", [
        (f"sum by (model) (nv_inference_pending_request_count{{{TRITON}}})", "{{model}}")]),
]  # fmt: skip


def _variable(name: str, label: str, query: str) -> dict:
    return {
        "name": name, "label": label, "type": "query", "datasource": DATASOURCE,
        "query": {"query": query, "refId": name}, "definition": query, "refresh": 2,
        "includeAll": True, "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"},
    }  # fmt: skip


def _panel(p: Panel, i: int) -> dict:
    defaults: dict = {"unit": p.unit}
    if p.max is not None:
        defaults.update(min=0, max=p.max)
    return {
        "id": i + 1, "type": p.kind, "title": p.title, "description": p.description, "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [{"refId": chr(65 + j), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
                    for j, (expr, legend) in enumerate(p.queries)],
        **p.extra,
    }  # fmt: skip


def dashboard(uid: str, title: str, panels: list[Panel], job: str, model_var: tuple[str, str] | None) -> dict:
    variables = [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {"text": "Prometheus", "value": "prometheus"}},
        _variable("job", "Job", f'label_values(up{{job=~"{job}"}}, job)'),
    ]  # fmt: skip
    if model_var:
        variables.append(_variable("model", "Model", f"label_values({model_var[0]}, {model_var[1]})"))
    return {
        "uid": uid, "title": title, "tags": ["llmserve"], "timezone": "browser", "editable": True,
        "schemaVersion": 39, "version": 1, "refresh": "10s", "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": variables}, "annotations": {"list": []},
        "panels": [_panel(p, i) for i, p in enumerate(panels)],
    }  # fmt: skip


DASHBOARDS = {
    "llmserve-engine.json": dashboard("llmserve-engine", "llmserve: engine", ENGINE_PANELS, "llmserve-engine",
                                      ("vllm:num_requests_running", "model_name")),
    "llmserve-gateway.json": dashboard("llmserve-gateway", "llmserve: gateway", GATEWAY_PANELS,
                                       "llmserve-gateway", None),
    "llmserve-triton.json": dashboard("llmserve-triton", "llmserve: Triton", TRITON_PANELS, "triton",
                                      ("nv_inference_count", "model")),
}  # fmt: skip


def render(name: str) -> str:
    return json.dumps(DASHBOARDS[name], indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    for name in DASHBOARDS:
        (OUT / name).write_text(render(name))
        print(OUT / name)
