"""`llmserve bench`: serve against a real server process, latency and hf-baseline in-process,
and the metric definitions on hand-built request results (exact numbers)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from server_utils import free_port, start_server

from llmserve.bench.prompts import random_requests
from llmserve.bench.report import parse_percentiles, summarize
from llmserve.bench.serve import arrival_offsets
from llmserve.bench.serve_client import RequestResult, Target, _carries_tokens
from llmserve.bench.serve_metrics import compute_metrics, parse_goodput, peak_concurrency
from llmserve.bench.server_metrics import parse, server_side
from llmserve.bench.throughput import make_prompts
from llmserve.cli import main

pytestmark = pytest.mark.integration

NUM, IN_LEN, OUT_LEN = 12, 16, 6
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    """The server, with its request and step timing logs at `server.log_path` + ".timing.jsonl"
    and + ".steps.jsonl"."""
    log = tmp_path_factory.mktemp("bench-server") / "server.log"
    srv = start_server(["--model", llama_dir, "--max-model-len", "256", "--request-timing-log", f"{log}.timing.jsonl",
                        "--step-timing-log", f"{log}.steps.jsonl"], str(log))  # fmt: skip
    yield srv
    srv.stop()


def bench_serve(base_url: str, out: str, *extra: str) -> dict:
    main([
        "bench", "serve", "--base-url", base_url, "--num-prompts", str(NUM), "--input-len", str(IN_LEN),
        "--output-len", str(OUT_LEN), "--vocab-size", "512", "--ignore-eos", "--percentiles", "50,90,99",
        "--disable-tqdm", "--output-json", out, *extra,
    ])  # fmt: skip
    with open(out) as f:
        return json.load(f)


def assert_consistent(r: dict, completed: int = NUM) -> None:
    assert r["completed"] == completed and r["failed"] == NUM - completed
    assert r["total_output_tokens"] == completed * OUT_LEN
    assert r["total_input_tokens"] == completed * IN_LEN
    d = r["duration"]
    assert d > 0
    assert r["request_throughput"] == pytest.approx(completed / d)
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / d)
    assert r["total_token_throughput"] == pytest.approx((r["total_input_tokens"] + r["total_output_tokens"]) / d)
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < r[f"p50_{m}_ms"] <= r[f"p90_{m}_ms"] <= r[f"p99_{m}_ms"], m
        assert r[f"median_{m}_ms"] == r[f"p50_{m}_ms"]
    assert r["mean_ttft_ms"] < r["mean_e2el_ms"] <= d * 1000
    assert 1 <= r["max_concurrent_requests"] <= NUM
    assert 0 < r["max_output_tokens_per_s"] <= r["total_output_tokens"]


def test_serve_all_at_once_with_plot(server, llama_dir, tmp_path, capsys):
    png = tmp_path / "plot.png"
    r = bench_serve(server.base_url, str(tmp_path / "r.json"), "--plot", str(png), "--goodput", "ttft:600000",
                    "--seed", "1", "--save-detailed")  # fmt: skip
    assert_consistent(r)
    assert r["request_rate"] == "inf" and r["seed"] == 1 and r["model_id"] == llama_dir  # the first of /v1/models
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # a 10-minute TTFT SLO: all good
    # a lagging stream gets several tokens in one chunk (the tiny model can finish all six before
    # the server's streaming catches up): at most one gap per token after the first
    assert len(r["ttfts"]) == NUM and all(len(gaps) <= OUT_LEN - 1 for gaps in r["itls"])
    assert sum(map(len, r["itls"])) > 0
    assert png.read_bytes()[:8] == PNG_MAGIC
    text = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in text
    assert "Successful requests:                     12" in text
    # the server's own view of the same 12 requests (its /metrics before and after the load)
    srv = r["server_metrics"]
    assert srv["ttft_count"] == srv["queue_count"] == srv["prefill_count"] == NUM
    # the server's TTFT lies inside the client's (after the request's arrival, before its bytes left)
    assert 0 < srv["mean_ttft_ms"] <= r["mean_ttft_ms"]
    # queue and prefill are the core's part of it (vLLM's split): from the core's intake to its first token
    assert 0 < srv["mean_queue_ms"] + srv["mean_prefill_ms"] <= srv["mean_ttft_ms"]
    assert srv["mean_e2el_ms"] <= r["mean_e2el_ms"]
    assert 0 < srv["p50_ttft_bucket_ms"] <= srv["p99_ttft_bucket_ms"]
    assert "Server side (/metrics)" in text and "Mean queue time (ms):" in text
    # the server's request timing log, joined with the client's detail by response id
    # (scripts/gpu/request_timeline.py): every request's phases add up to the client's TTFT
    timeline = gpu_script("request_timeline")
    records = timeline.read_log(Path(f"{server.log_path}.timing.jsonl"))
    rows = timeline.join(r, records)
    assert len(rows) == NUM and {row["index"] for row in rows} == set(range(NUM))
    for row in rows:
        phases = [row[name] for name, _, _ in timeline.PHASES]
        assert sum(phases) == pytest.approx(row["ttft_ms"], abs=1e-3)
        # one host's clock, so each later time is later; the phases compare wall clocks read in
        # three processes (and the client's perf_counter), which a loaded VM's clock adjustment
        # can shift by a few ms (one CI run under load had a phase below 0)
        named = dict(zip([name for name, _, _ in timeline.PHASES], phases))
        assert all(v >= -20 for v in phases[1:]), named
        assert -5 < phases[0] < row["ttft_ms"]  # the client stamps its send a moment before it sends
        rec = records[row["request_id"]]
        assert rec["finish_reason"] == "length" and rec["prompt_tokens"] == IN_LEN and rec["output_tokens"] == OUT_LEN
    import subprocess
    import sys

    png = tmp_path / "timeline.png"
    out = subprocess.run([sys.executable, timeline.__file__, f"{server.log_path}.timing.jsonl", str(tmp_path / "r.json"),
                          "--plot", str(png), "--steps", f"{server.log_path}.steps.jsonl"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert f"{NUM} of {NUM} requests joined" in out and "to_core" in out and "slowest first tokens" in out
    assert "with prefill); its step: " in out
    assert png.read_bytes()[:8] == PNG_MAGIC
    # the engine core's step log (the server's --step-timing-log): every request's first step is in it
    steps = timeline.read_steps(Path(f"{server.log_path}.steps.jsonl"))
    assert all(s["launch"] <= s["launched"] <= s["done"] and s["prefill"] <= s["tokens"] for s in steps)
    for row in rows:
        scheduled = records[row["request_id"]]["first_scheduled_time"]
        first = [s for s in steps if s["launch"] <= scheduled <= s["launched"]]
        assert len(first) == 1 and first[0]["new"] >= 1 and first[0]["prefill"] >= IN_LEN


def gpu_script(name: str):
    """scripts/gpu/NAME.py as a module (the scripts are not a package)."""
    import importlib.util

    path = Path(__file__).parents[1] / f"scripts/gpu/{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serve_keeps_its_start_up_heap_out_of_gc_scans_while_measuring(server, tmp_path, monkeypatch):
    """The client's own full collections stalled every stream at once for ~0.1 s on the
    GPU host (read as the server's TTFT and ITL): its heap is frozen during the load."""
    import gc

    from llmserve.bench import serve as bench_serve_module

    seen = []
    real = bench_serve_module.run_load

    async def watched(*args, **kwargs):
        seen.append(gc.get_freeze_count())
        return await real(*args, **kwargs)

    monkeypatch.setattr(bench_serve_module, "run_load", watched)
    assert gc.get_freeze_count() == 0
    r = bench_serve(server.base_url, str(tmp_path / "r.json"), "--request-rate", "100")
    assert r["completed"] == NUM
    assert len(seen) == 1 and seen[0] > 10_000  # the imported modules, the prompts, the client
    assert gc.get_freeze_count() == 0  # and collectable again afterwards


def test_serve_finite_rate_and_concurrency_cap(server, tmp_path):
    r = bench_serve(server.base_url, str(tmp_path / "r.json"), "--request-rate", "40", "--max-concurrency", "3")
    assert_consistent(r)
    assert r["request_rate"] == 40.0 and r["max_concurrency"] == 3
    assert r["max_concurrent_requests"] <= 3
    assert r["request_goodput"] is None and "ttfts" not in r  # no SLOs, not detailed
    assert r["seed"] != bench_serve(server.base_url, str(tmp_path / "r2.json"))["seed"]  # fresh prompts each run


def test_serve_chat_endpoint(server, tmp_path):
    r = bench_serve(server.base_url, str(tmp_path / "r.json"), "--endpoint", "/v1/chat/completions", "--warmup", "0")
    assert r["completed"] == NUM and r["total_output_tokens"] == NUM * OUT_LEN
    assert r["total_input_tokens"] >= NUM * 4  # re-tokenized text plus the chat template: the server's count


def test_serve_against_nothing_reports_failures(tmp_path, capsys):
    r = bench_serve(f"http://127.0.0.1:{free_port()}", str(tmp_path / "r.json"), "--model", "m", "--plot",
                    str(tmp_path / "p.png"))  # fmt: skip
    assert r["completed"] == 0 and r["failed"] == NUM and r["server_metrics"] is None
    assert r["total_output_tokens"] == 0 and r["request_throughput"] == 0 and r["mean_ttft_ms"] == 0
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG_MAGIC
    assert "ConnectError" in capsys.readouterr().err


def test_serve_stops_when_the_server_refuses_its_requests(server, tmp_path):
    """Prompt ids beyond the model's vocabulary: the warm-up's 400 ends the run at once,
    saying why, instead of sending every request to the same refusal."""
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exc:
        bench_serve(server.base_url, str(out), "--vocab-size", "100000")
    assert "refused the warm-up request" in str(exc.value) and "HTTP 400" in str(exc.value)
    assert "vocab" in str(exc.value) and not out.exists()


def test_latency(llama_dir, tmp_path):
    out = tmp_path / "lat.json"
    main([
        "bench", "latency", "--model", llama_dir, "--max-model-len", "128", "--batch-size", "2",
        "--input-len", "16", "--output-len", "6", "--num-iters", "3", "--num-iters-warmup", "1",
        "--output-json", str(out),
    ])  # fmt: skip
    r = json.loads(out.read_text())
    assert r["batch_size"] == 2 and len(r["latencies"]) == 3 and len(r["ttfts"]) == 3
    assert 0 < r["ttft_ms"] and 0 < r["tpot_ms"] and r["weight_bandwidth_gb_s"] > 0
    ttft, whole = sorted(r["ttfts"])[1], sorted(r["latencies"])[1]  # medians: one stall moves neither
    assert r["ttft_ms"] == pytest.approx(ttft * 1000) and r["tpot_ms"] == pytest.approx((whole - ttft) / 5 * 1000)
    assert r["avg_latency"] == pytest.approx(sum(r["latencies"]) / 3)
    assert min(r["latencies"]) <= r["percentiles"]["50"] <= r["percentiles"]["90"] <= r["percentiles"]["99"]


def test_latency_of_a_prompt_file_with_speculation(tmp_path):
    """--prompt-file: every request's prompt is the file's text (through the chat template);
    with --speculative-config the report gives the acceptance over the timed runs."""
    from llmserve.config import TINY_MODEL_DIR

    prompt = tmp_path / "rewrite.txt"
    prompt.write_text("Copy this list: red green blue red green blue red green blue red green blue")
    out = tmp_path / "lat.json"
    main([
        "bench", "latency", "--model", str(TINY_MODEL_DIR), "--max-model-len", "256", "--prompt-file", str(prompt),
        "--output-len", "24", "--num-iters", "2", "--num-iters-warmup", "0", "--no-enable-prefix-caching",
        "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}),
        "--output-json", str(out),
    ])  # fmt: skip
    r = json.loads(out.read_text())
    assert r["prompt_file"] == str(prompt) and r["input_len"] > 15
    spec = r["spec_decode"]
    assert spec["draft_tokens"] > 0 and spec["verifications"] > 0
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted_tokens"] / spec["draft_tokens"])
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["verifications"])


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_hf_baseline(llama_dir, tmp_path, load_format, capsys):
    out = tmp_path / "hf.json"
    main([
        "bench", "hf-baseline", "--model", llama_dir, "--num-prompts", "5", "--batch-size", "2",
        "--input-len", "12", "--output-len", "5", "--device", "cpu", "--load-format", load_format,
        "--output-json", str(out),
    ])  # fmt: skip
    r = json.loads(out.read_text())
    assert r["dtype"] == "float32" and r["device"] == "cpu"
    assert r["total_output_tokens"] == 5 * 5 and r["total_input_tokens"] == 5 * 12  # EOS ignored, 3 batches
    assert r["output_tokens_per_s"] == pytest.approx(r["total_output_tokens"] / r["elapsed_s"])
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[hf-baseline]")]
    assert [line.split(":")[0] for line in progress] == [
        "[hf-baseline] warm-up batch (2 requests)", "[hf-baseline] batch 1/3 (2 requests)",
        "[hf-baseline] batch 2/3 (2 requests)", "[hf-baseline] batch 3/3 (1 request)"]  # fmt: skip


# ---- the definitions, on hand-built results ----


def result(start: float, ttft: float, latency: float, tokens: int, ok: bool = True) -> RequestResult:
    gaps = [(latency - ttft) / (tokens - 1)] * (tokens - 1) if ok and tokens > 1 else []
    times = [start + ttft + sum(gaps[:i]) for i in range(tokens)] if ok else []
    return RequestResult(
        success=ok, prompt_len=10 if ok else 0, output_tokens=tokens if ok else 0, start=start,
        ttft=ttft, latency=latency, itl=gaps, token_times=times, error="" if ok else "boom",
    )  # fmt: skip


def test_server_side_metrics_from_prometheus_text():
    """Two scrapes of vLLM-named histograms (two models, so label sets are summed): the
    observations in between, their means and the bucket holding each percentile."""

    def text(ttft_sum: float, buckets: dict[str, float], queue_sum: float) -> str:
        lines = [
            "# HELP vllm:time_to_first_token_seconds Time to first token.",
            "# TYPE vllm:time_to_first_token_seconds histogram",
        ]
        for model in ("a", "b"):
            for le, n in buckets.items():
                lines.append(f'vllm:time_to_first_token_seconds_bucket{{le="{le}",model_name="{model}"}} {n / 2}')
            lines.append(f'vllm:time_to_first_token_seconds_count{{model_name="{model}"}} {buckets["+Inf"] / 2}')
            lines.append(f'vllm:time_to_first_token_seconds_sum{{model_name="{model}"}} {ttft_sum / 2}')
            lines.append(f'vllm:request_queue_time_seconds_count{{model_name="{model}"}} {buckets["+Inf"] / 2}')
            lines.append(f'vllm:request_queue_time_seconds_sum{{model_name="{model}"}} {queue_sum / 2}')
            lines.append(f'vllm:num_requests_running{{model_name="{model}"}} 3.0')
        return "\n".join(lines) + "\n"

    before = parse(text(1.0, {"0.04": 4, "0.1": 10, "0.25": 10, "+Inf": 10}, 0.5))
    # 100 more requests: 90 within 40 ms, 8 more within 100 ms, 2 more within 250 ms; 5 s of TTFT, 1 s queued
    after = parse(text(6.0, {"0.04": 94, "0.1": 108, "0.25": 110, "+Inf": 110}, 1.5))
    assert before["vllm:time_to_first_token_seconds_bucket|0.1"] == 10
    assert "vllm:num_requests_running" not in before  # not a histogram of ours
    got = server_side(before, after, [50, 90, 99, 99.9])
    assert got["ttft_count"] == got["queue_count"] == 100
    assert got["mean_ttft_ms"] == pytest.approx(50.0) and got["mean_queue_ms"] == pytest.approx(10.0)
    assert got["p50_ttft_bucket_ms"] == got["p90_ttft_bucket_ms"] == pytest.approx(40.0)
    assert got["p99_ttft_bucket_ms"] == pytest.approx(250.0) and got["p99.9_ttft_bucket_ms"] == pytest.approx(250.0)
    assert "mean_prefill_ms" not in got  # a server without that histogram
    assert server_side(None, after, [99]) is None and server_side(before, before, [99]) is None
    assert parse('vllm:time_to_first_token_seconds_sum{model_name="a"} not-a-number\n') == {}


def test_metrics_definitions():
    results = [result(0.0, 0.1, 0.5, 5), result(0.25, 0.3, 1.3, 11), result(0.4, 0.0, 0.1, 0, ok=False)]
    m = compute_metrics(results, duration=2.0, percentiles=[50, 99], slos={"ttft": 200})
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (20, 16)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 8.0 and m["total_token_throughput"] == 18.0
    assert m["request_goodput"] == 0.5  # only the first meets TTFT <= 200 ms
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # (0.5 - 0.1) / 4 and (1.3 - 0.3) / 10
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_e2el_ms"] == pytest.approx(900.0)
    assert m["mean_itl_ms"] == pytest.approx(100.0) and m["p99_itl_ms"] == pytest.approx(100.0)
    assert m["max_concurrent_requests"] == 3  # [0, .5], [.25, 1.55] and the failed [.4, .5] overlap
    assert m["max_output_tokens_per_s"] == 10  # second [0, 1): 5 + 5 chunks; [1, 2): 6


def test_tpot_slo_and_one_token_outputs():
    one = result(0.0, 0.05, 0.05, 1)
    assert one.tpot is None
    m = compute_metrics([one], 1.0, [90], parse_goodput(["tpot:1", "e2el:100"]))
    assert m["request_goodput"] == 1.0 and m["mean_tpot_ms"] == 0.0 and m["p90_itl_ms"] == 0.0


def test_peak_concurrency_back_to_back_is_one():
    assert peak_concurrency([result(0.0, 0.1, 1.0, 2), result(1.0, 0.1, 1.0, 2)]) == 1


def test_arrival_offsets():
    assert arrival_offsets(4, math.inf, 1.0, 0) == [0.0] * 4
    offsets = arrival_offsets(2000, 50.0, 1.0, 0)
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert offsets[-1] / 1999 == pytest.approx(1 / 50, rel=0.1)
    assert arrival_offsets(50, 10.0, 1.0, 7) == arrival_offsets(50, 10.0, 1.0, 7)


def test_stream_chunks_that_carry_tokens():
    assert _carries_tokens({"text": "a", "finish_reason": None}, chat=False)
    assert _carries_tokens({"text": "", "finish_reason": None}, chat=False)  # half of a UTF-8 character
    assert not _carries_tokens({"text": "", "finish_reason": "length"}, chat=False)
    assert not _carries_tokens({"delta": {"role": "assistant", "content": ""}, "finish_reason": None}, chat=True)
    assert _carries_tokens({"delta": {"role": None, "content": "hi"}, "finish_reason": "stop"}, chat=True)


def test_request_bodies():
    comp = Target("http://h:1/", "/v1/completions", "m", api_key="k", ignore_eos=True)
    body = comp.payload([11, 12], 7)
    assert comp.url == "http://h:1/v1/completions" and comp.headers() == {"Authorization": "Bearer k"}
    assert body["prompt"] == [11, 12] and body["max_tokens"] == 7 and body["ignore_eos"] and body["model"] == "m"
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["temperature"] == 0.0
    chat = Target("http://h:1", "/v1/chat/completions", None)
    body = chat.payload("hi", 7)
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["max_completion_tokens"] == 7
    assert "model" not in body and "ignore_eos" not in body and chat.headers() == {}


def test_bad_options():
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])
    with pytest.raises(ValueError):
        parse_percentiles("0,50")
    assert summarize([], [99], "x_ms") == {"mean_x_ms": 0.0, "median_x_ms": 0.0, "std_x_ms": 0.0, "p99_x_ms": 0.0}


def test_prompts_exact_and_shared_with_throughput():
    reqs = random_requests(5, 32, 8, 512, seed=3)
    assert all(r.prompt_len == 32 and r.output_len == 8 for r in reqs)
    assert all(10 <= t < 512 for r in reqs for t in r.prompt_token_ids)
    prompts, out_lens = make_prompts(5, 32, 8, 0.0, 512, 3)
    assert [p["prompt_token_ids"] for p in prompts] == [r.prompt_token_ids for r in reqs] and out_lens == [8] * 5
    assert random_requests(5, 32, 8, 512, seed=None) != random_requests(5, 32, 8, 512, seed=None)


def test_gpu_summary_table(tmp_path):
    """scripts/gpu/summary.py (the one table of a device call) reads what the bench commands write."""
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "a.json").write_text(json.dumps({"output_tokens_per_s": 10150.0, "startup_s": 30.0}))
    (tmp_path / "hf.json").write_text(json.dumps({"output_tokens_per_s": 2030.0}))
    (tmp_path / "b.json").write_text(json.dumps({"tpot_ms": 4.9, "ttft_ms": 14.0}))
    (tmp_path / "kernels.json").write_text(json.dumps({"checks": [{"ok": True}, {"ok": False}]}))
    (tmp_path / "d_rate16_x.json").write_text(json.dumps({
        "p99_ttft_ms": 90.0, "p99_tpot_ms": 8.0, "mean_ttft_ms": 41.0,
        "server_metrics": {"mean_ttft_ms": 30.0, "mean_queue_ms": 12.5, "mean_prefill_ms": 17.5},
    }))  # fmt: skip
    out = subprocess.run(
        [sys.executable, str(Path(__file__).parents[1] / "scripts/gpu/summary.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "| (a) 512 x 512/256, output tok/s | 10,150.0 | >= 10,150 | 1.00 |" in out
    assert (
        "| (a) / HF of the same call | 5.00x | >= 5x | 1.00 |" in out and "| 1/2 within tolerance | all | FAIL |" in out
    )
    assert "(b) batch 1" in out and "(c)" not in out and (tmp_path / "summary.md").read_text() == out
    assert "| (d) 16 req/s TTFT p99 ms (d_rate16_x) | 90.0 | <= 99 | 1.10 |" in out
    assert (
        "| (d) server side: mean TTFT / queue / prefill ms (d_rate16_x) | 30.0 / 12.5 / 17.5 | client mean TTFT 41.0 |"
        in out
    )


def test_serve_stalls_finds_a_stall_of_every_stream(tmp_path):
    """scripts/gpu/serve_stalls.py on hand-built per-request detail: three streams share a
    0.12 s gap (then tokens back to back), a fourth has an ordinary one; the slowest first
    token is the one that arrived behind two others."""
    import subprocess
    import sys
    from pathlib import Path

    run = {
        "seed": 7, "p99_ttft_ms": 90.0, "mean_ttft_ms": 40.0, "p99_tpot_ms": 8.0,
        "start_times": [0.0, 0.01, 0.02, 1.0],
        "ttfts": [0.03, 0.035, 0.09, 0.02],
        # streams 0-2: tokens every 7 ms, one 120 ms gap around t=0.5 s, then three back to back
        "itls": [[0.007] * 60 + [0.12, 0.0002, 0.0003, 0.0001, 0.007] for _ in range(3)] + [[0.007, 0.065, 0.007]],
    }  # fmt: skip
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    script = Path(__file__).parents[1] / "scripts/gpu/serve_stalls.py"
    out = subprocess.run([sys.executable, str(script), str(path), "--summary", str(tmp_path / "s.json")],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    summary = json.loads((tmp_path / "s.json").read_text())[0]
    shared = [s for s in summary["stalls"] if s["streams"] >= 3]
    assert len(shared) == 1 and shared[0]["max_gap_ms"] == pytest.approx(120.0)
    assert shared[0]["max_back_to_back"] == 3 and shared[0]["at_s"] == pytest.approx(0.45)
    assert len(summary["stalls"]) == 2  # the fourth stream's 65 ms gap, alone
    assert summary["worst_ttft"][0] == {"at_s": 0.02, "ttft_ms": 90.0, "arrived_before": 2}
    assert "stalls: 120 ms at 0.5 s (3 streams)" in out


def test_stub_server_streams_like_an_engine(tmp_path):
    """scripts/stub_openai_server.py (for measuring the client's own overhead): bench serve
    reads every token of every request from it, and its first token takes two ticks."""
    import sys
    from pathlib import Path

    from server_utils import spawn, wait_healthy

    port = free_port()
    script = Path(__file__).parents[1] / "scripts/stub_openai_server.py"
    stub = wait_healthy(spawn([sys.executable, str(script), "--port", str(port), "--tick-ms", "20"], port,
                              str(tmp_path / "stub.log")), timeout=30)  # fmt: skip
    try:
        r = bench_serve(stub.base_url, str(tmp_path / "r.json"), "--request-rate", "50")
        assert_consistent(r)
        assert r["model_id"] == "stub" and r["p50_ttft_ms"] >= 20  # at least one whole tick, then the first token
    finally:
        stub.stop(10)


def test_step_times_from_a_step_log(tmp_path):
    """scripts/gpu/step_times.py: a step's device time starts when both its launch and the
    step before it are done; steps go into buckets by their prefill tokens."""
    import subprocess
    import sys

    mod = gpu_script("step_times")
    steps = [  # times in s: a decode, a prefill launched while it runs, a decode launched late
        {"launch": 10.000, "launched": 10.001, "done": 10.007, "prefill": 0},
        {"launch": 10.002, "launched": 10.004, "done": 10.040, "prefill": 1024},
        {"launch": 10.050, "launched": 10.052, "done": 10.058, "prefill": 0},
    ]
    timed = mod.device_times(list(reversed(steps)))  # any order in: launch order out
    assert [round(s["device_ms"], 3) for s in timed] == [6.0, 33.0, 6.0]
    assert [mod.bucket_of(n) for n in (0, 1, 512, 513, 1536, 2048, 5000)] == [
        "decode only",
        "1-512",
        "1-512",
        "513-1024",
        "1025-1536",
        "1537-2048",
        "> 2048",
    ]
    log = tmp_path / "steps.jsonl"
    log.write_text("".join(json.dumps(s) + "\n" for s in steps))
    out = subprocess.run([sys.executable, mod.__file__, str(log), "--split-s", "0.03"], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    assert "3 steps over 0.1 s" in out
    assert "decode only           2      6.0      6.0      6.0" in out
    assert "513-1024              1     33.0     33.0     33.0" in out
    early, late = out.split("the first 0.03 s of each busy period:")[1].split("the rest:")
    assert "513-1024" in early and "decode only           1" in early and "513-1024" not in late


def test_bench_placement_table_json_plot_and_default_policy(tmp_path, capsys):
    """`llmserve bench placement`: every policy and the static set on four traces per cost
    table, the table printed, the rows in JSON, a PNG; the platform's default policy is the
    one it reports best in the worst case."""
    from llmserve.bench.placement import POLICIES, overall_best
    from llmserve.gateway.config import PlacementConfig

    out, png = tmp_path / "p.json", tmp_path / "p.png"
    main(["bench", "placement", "--duration-s", "600", "--rate", "0.5", "--costs", "measured", "no_arenas",
          "--output-json", str(out), "--plot", str(png)])  # fmt: skip
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * 4 * (len(POLICIES) + 1) and "| no_arenas | mixed | demand |" in text
    assert {r["policy"] for r in rows} == {"static", *POLICIES}
    assert all(0.0 <= r["slo_attainment"] <= 1.0 and r["requests"] > 0 for r in rows)
    assert all(r["wakes_per_hour"] == 0 and r["refused"] > 0 for r in rows if r["policy"] == "static")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"best worst case over the cost tables: {overall_best(rows)}" in text
    assert PlacementConfig.model_fields["policy"].default == "demand"


@pytest.mark.parametrize(("args", "words"), [
    (["--duration-s", "0"], "must be positive"), (["--costs", "nowhere.json"], "--costs nowhere.json"),
    (["--costs", "guessed"], "unknown cost table"),
])  # fmt: skip
def test_bench_placement_bad_arguments_are_clear(args, words, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "placement", *args])
    assert exc.value.code != 0 and words in str(exc.value.code) + capsys.readouterr().err


def test_bench_soak_records_every_window_of_a_real_server(server, tmp_path, capsys):
    """A short soak of the real server: every window has its requests (ok, left on purpose,
    none failed), SLO attainment, TTFT, the server process's memory and open files and its
    queue gauges; the summary, the JSON and the PNG."""
    out, png = tmp_path / "soak.json", tmp_path / "soak.png"
    main(["bench", "soak", "--base-url", server.base_url, "--duration", "6", "--window", "2", "--rate", "4",
          "--max-tokens", "8", "--short-words", "20", "--long-words", "60", "--pids", str(server.proc.pid),
          "--warmup-windows", "1", "--ttft-slo-ms", "60000", "--tpot-slo-ms", "10000", "--seed", "3",
          "--chat-share", "0",  # this random model has no chat template
          "--output-json", str(out), "--plot", str(png)])  # fmt: skip
    result = json.loads(out.read_text())
    windows, summary = result["windows"], result["summary"]
    assert [w["start_s"] for w in windows] == [0, 2, 4] and sum(w["sent"] for w in windows) == summary["requests"] > 8
    assert summary["errors"] == {} and summary["shed"] == 0, summary["error_examples"]
    assert summary["ok"] + summary["left_on_purpose"] == summary["requests"] and summary["ok"] > 0
    assert summary["slo_attainment"] == 1.0  # generous targets: every finished request meets them
    for w in windows:
        server_procs = [p for p in w["rss_mb"] if p.startswith(f"{server.proc.pid} ")]
        assert server_procs and w["rss_mb"][server_procs[0]] > 50 and w["open_files"][server_procs[0]] > 0
        assert {"running", "waiting", "kv_cache_usage"} <= set(w["server"])
    assert windows[0]["ttft_p50_ms"] > 0 and set(summary["rss_growth_pct_after_warmup"]) == set(windows[-1]["rss_mb"])
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert "SLO attainment 1.0" in capsys.readouterr().out


def test_bench_soak_bad_arguments_are_clear(capsys):
    with pytest.raises(SystemExit, match="must be positive"):
        main(["bench", "soak", "--base-url", "http://127.0.0.1:9", "--rate", "0"])


def test_throughput_and_latency_with_lora_adapters_taken_in_turn(llama_dir, tmp_path, monkeypatch):
    """--lora-adapters: random PEFT adapters of the model's shape (read back by the engine's own
    reader), requests spread over them, fewer slots than adapters (swapped during the run);
    the temporary adapters are removed afterwards."""
    import glob
    import tempfile

    from llmserve.lora import read_peft_adapter
    from llmserve.lora.synthetic import write_random_adapter
    from llmserve.model.arch import read_model_arch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = tmp_path / "tp.json"
    main(["bench", "throughput", "--model", llama_dir, "--max-model-len", "128", "--num-prompts", "12",
          "--input-len", "8", "--output-len", "4", "--lora-adapters", "3", "--lora-rank", "4", "--max-loras", "2",
          "--output-json", str(out)])  # fmt: skip
    r = json.loads(out.read_text())
    assert r["lora"].pop("slot_loads") >= 3  # each adapter written into a slot at least once (2 slots)
    assert r["lora"] == {"adapters": 3, "rank": 4, "max_loras": 2} and r["num_requests"] == 12
    assert r["output_tokens_per_s"] > 0
    assert not glob.glob(str(tmp_path / "llmserve-bench-lora-*"))
    lat = tmp_path / "lat.json"
    main(["bench", "latency", "--model", llama_dir, "--max-model-len", "128", "--batch-size", "2", "--input-len", "8",
          "--output-len", "3", "--num-iters", "1", "--num-iters-warmup", "0", "--lora-adapters", "1",
          "--output-json", str(lat)])  # fmt: skip
    assert json.loads(lat.read_text())["lora"] == {"adapters": 1, "rank": 16, "max_loras": 1, "slot_loads": 1}
    arch = read_model_arch(Path(llama_dir))
    adapter = read_peft_adapter(write_random_adapter(arch, tmp_path / "one", 4, 0), "one", arch, 16)
    assert adapter.rank == 4 and len(adapter.modules) == 7 * arch.num_layers


def test_bench_aborts_leaves_nothing_running_after_a_storm_of_cut_streams(server, tmp_path):
    """A short storm (the documented run sends 10,000): streams cut before their first chunk, in
    the middle and at random moments; afterwards no request runs or waits, no KV block is held,
    and the next request is served whole."""
    out = tmp_path / "aborts.json"
    main(["bench", "aborts", "--base-url", server.base_url, "--count", "300", "--concurrency", "16",
          "--max-tokens", "32", "--chat-share", "0", "--output-json", str(out)])  # fmt: skip
    r = json.loads(out.read_text())
    assert r["passed"] and r["next_request_ok"] and r["errors"] == {}
    assert r["cut_before_first_chunk"] > 0 and r["cut_mid_stream"] > 100 and r["finished"] > 0
    assert r["cut_before_first_chunk"] + r["cut_mid_stream"] + r["finished"] == 300
    assert r["left_behind"]["vllm:num_kv_blocks_used"] == 0 and r["left_behind"]["vllm:num_requests_running"] == 0


def test_bench_aborts_fails_when_the_server_keeps_requests(tmp_path):
    """Against a server whose gauges never empty (a stub /metrics), the run fails (exit 1)."""
    from server_utils import StubHandler, stub_server

    class Stuck(StubHandler):
        def do_GET(self):
            self.reply(b"vllm:num_requests_running 3\nvllm:num_kv_blocks_used 7\n" if self.path == "/metrics"
                       else b'{"data": [{"id": "m"}]}')  # fmt: skip

        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            self.reply(b'data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]\n\n', "text/event-stream")

    with stub_server(Stuck) as stub:
        with pytest.raises(SystemExit) as exc:
            main(["bench", "aborts", "--base-url", f"http://127.0.0.1:{stub.server_port}", "--count", "10",
                  "--concurrency", "2", "--settle-timeout", "1", "--chat-share", "0",
                  "--output-json", str(tmp_path / "a.json")])  # fmt: skip
        assert exc.value.code == 1
        r = json.loads((tmp_path / "a.json").read_text())
        assert not r["passed"] and r["left_behind"]["vllm:num_requests_running"] == 3


MIX = json.dumps([
    {"temperature": 0},
    {"temperature": 0.7, "top_p": 0.9, "presence_penalty": 0.3, "frequency_penalty": 0.3, "sampling_seed": 5},
    {"temperature": 0, "repetition_penalty": 1.1, "logprobs": 2},
])  # fmt: skip


def test_a_sampling_mix_gives_each_request_its_kind_and_each_its_own_tokens_in_a_batch(llama_dir, tmp_path):
    """--sampling-mix: request i takes entry i % 3 over the flags; in one batch each request gets
    the tokens (and logprobs) it gets alone; the command reports the mix."""
    import argparse

    from llmserve import LLM
    from llmserve.bench.sampling_args import add_sampling_args, sampling_params

    parser = argparse.ArgumentParser()
    add_sampling_args(parser)
    args = parser.parse_args(["--top-k", "20", "--sampling-mix", MIX])
    params = [sampling_params(args, 6, i) for i in range(6)]
    assert [p.temperature for p in params] == [0, 0.7, 0] * 2 and all(p.top_k == 20 for p in params)
    assert [p.seed for p in params] == [None, 6, None, None, 9, None]  # the entry's seed + the request's index
    assert params[1].presence_penalty == params[4].frequency_penalty == 0.3 and params[2].repetition_penalty == 1.1
    assert [p.logprobs for p in params] == [None, None, 2] * 2

    llm = LLM(llama_dir, max_model_len=128, block_size=16)
    prompts, _ = make_prompts(6, 12, 6, 0.0, 512, 11)
    batch = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, together in zip(prompts, params, batch):
        alone = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        assert together.outputs[0].token_ids == alone.token_ids
        if p.logprobs:
            for a, b in zip(together.outputs[0].logprobs, alone.logprobs):
                assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)

    out = tmp_path / "mix.json"
    main(["bench", "throughput", "--model", llama_dir, "--max-model-len", "128", "--num-prompts", "6",
          "--input-len", "8", "--output-len", "4", "--sampling-mix", MIX, "--output-json", str(out)])  # fmt: skip
    r = json.loads(out.read_text())
    assert r["sampling"] == {"mix": json.loads(MIX)} and r["num_requests"] == 6 and r["output_tokens_per_s"] > 0


@pytest.mark.parametrize("mix, words", [
    ("[{", "not JSON"),
    ("[]", "non-empty JSON list"),
    ('{"temperature": 0}', "non-empty JSON list"),
    ('[{"temprature": 0}]', "unknown setting 'temprature'"),
    ('[{"top_k": 1.5}]', "top_k: 1.5 is not an integer"),
    ('[{"top_p": "0.9"}]', "top_p: '0.9' is not a number"),
    ('[{"top_p": 2}]', "top_p"),
])  # fmt: skip
def test_a_bad_sampling_mix_is_a_clear_usage_error(mix, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "throughput", "--model", "unused", "--sampling-mix", mix])
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_the_engines_start_up_by_phase_is_logged_and_plotted(llama_dir, tmp_path, caplog):
    """The engine logs its start-up by phase; scripts/gpu/plot_startup_phases.py reads that line
    (as kept in a calls file) into the phases, whose sum is within the logged ready time, and plots it."""
    import logging

    from llmserve import LLM

    with caplog.at_level(logging.INFO, logger="llmserve.engine.engine_core"):
        LLM(llama_dir, max_model_len=64).shutdown()
    line = next(r.getMessage() for r in caplog.records if "start-up by phase" in r.getMessage())
    ready = float(next(r.getMessage() for r in caplog.records if "engine core ready in" in r.getMessage()).split()[4])
    plot = gpu_script("plot_startup_phases")
    phases = plot.phases(line)
    assert list(phases) == ["model", "memory profile", "KV cache", "kernel warm-up", "CUDA graphs"]
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= ready + 0.3
    calls = tmp_path / "calls.json"
    calls.write_text(json.dumps({"calls": {"c": {"logs": {"one.log": ["other", line], "two.log": ["no phases"]}}}}))
    import subprocess
    import sys

    png = tmp_path / "phases.png"
    subprocess.run([sys.executable, str(Path(__file__).parents[1] / "scripts/gpu/plot_startup_phases.py"), str(calls), "c",
                    str(png), "t"], check=True, capture_output=True)  # fmt: skip
    assert png.read_bytes().startswith(PNG_MAGIC)
