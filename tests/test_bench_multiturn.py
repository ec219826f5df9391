"""`llmserve bench multiturn` against a real server whose KV cache is smaller than the
conversations' working set, with the prefix cache's host tier under it."""

from __future__ import annotations

import json

import pytest
from server_utils import start_server

from llmserve.bench.multiturn import KV_COUNTERS, kv_deltas
from llmserve.cli import main

pytestmark = pytest.mark.integration

CONVS, TURNS, SYSTEM, USER, OUT = 4, 3, 32, 16, 8
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_multiturn_hits_the_prefix_cache_and_the_host_tier(llama_dir, tmp_path, capsys):
    # 20 blocks of 8 tokens: 160, for a working set of 2 x 32 + 4 x 3 x (16 + 8) = 352
    srv = start_server(["--model", llama_dir, "--max-model-len", "128", "--block-size", "8",
                        "--num-gpu-blocks-override", "20", "--admission-reserve-tokens", "0",
                        "--kv-offload-cpu-gb", "0.001"], str(tmp_path / "server.log"))  # fmt: skip
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    try:
        main([
            "bench", "multiturn", "--base-url", srv.base_url, "--num-conversations", str(CONVS), "--num-turns",
            str(TURNS), "--num-system-prompts", "2", "--system-prompt-len", str(SYSTEM), "--user-len", str(USER),
            "--output-len", str(OUT), "--max-concurrency", "2", "--vocab-size", "512", "--seed", "3",
            "--disable-tqdm", "--save-detailed", "--output-json", str(out), "--plot", str(png),
        ])  # fmt: skip
    finally:
        srv.stop()
    r = json.loads(out.read_text())
    assert r["completed"] == CONVS * TURNS and r["failed"] == r["skipped_turns"] == 0
    assert r["total_output_tokens"] == CONVS * TURNS * OUT
    assert r["kv_cache_tokens"] == 160 and r["working_set_tokens"] == 2 * SYSTEM + CONVS * TURNS * (USER + OUT)
    assert r["working_set_factor"] == pytest.approx(352 / 160)
    # every reply's ids came with its stream, and each turn's prompt extends the previous one's with its reply
    assert r["reply_ids_from"] == {"token_ids": CONVS * TURNS}
    prompt_lens = {(t["conversation"], t["turn"]): t["prompt_len"] for t in r["turns"]}
    for (conv, turn), length in prompt_lens.items():
        assert length == (prompt_lens[conv, turn - 1] + OUT if turn else SYSTEM) + USER
    for key in ("ttft", "ttft_later_turns"):
        assert 0 < r[f"p50_{key}_ms"] <= r[f"p90_{key}_ms"] <= r[f"p99_{key}_ms"]
    assert [t["completed"] for t in r["ttft_by_turn"]] == [CONVS] * TURNS
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"])
    # the server's counters over the run: the shared system prompts and the histories hit, and
    # what the small device cache evicted came back from host memory
    assert 0 < r["prefix_cache_hits"] <= r["prefix_cache_queries"]
    assert 0 < r["prefix_cache_hit_rate"] <= 1
    assert r["kv_offload_hit_tokens"] > 0 and r["kv_offload_loaded_blocks"] > 0 and r["kv_offload_stored_blocks"] > 0
    assert r["server_metrics"]["ttft_count"] == CONVS * TURNS + 0  # the warm-up came before the first scrape
    assert png.read_bytes()[:8] == PNG_MAGIC
    text = capsys.readouterr().out
    assert "Multi-turn Benchmark Result" in text and "Host tier hit tokens:" in text


def test_counters_a_server_does_not_export_are_none():
    """vLLM has no host-tier counters (and an OpenAI server no /metrics): None, not 0."""
    kv = kv_deltas({}, {"prefix_cache_queries": 100.0, "prefix_cache_hits": 25.0})
    assert kv["prefix_cache_hit_rate"] == 0.25 and kv["kv_offload_hit_tokens"] is None
    assert kv_deltas({}, {}) == dict.fromkeys([*KV_COUNTERS.values(), "prefix_cache_hit_rate"])
