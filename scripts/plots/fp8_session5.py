"""The plot next to docs/history/benchmarks.md's "FP8 past every target" section (2026-12-02, session 5):
the FP8 rows before and after each change, as a ratio to issue 19's targets, and the fused
SiLU-and-multiply with FP8 quantization at four token counts before and after (µs).

    python scripts/plots/fp8_session5.py   # writes docs/gpu_fp8_fast_paths_2026-12-02.png
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs"
TARGETS = {"a": 14600.0, "b": 3.4, "c": 5650.0}  # (b): ms a token, lower is better


def main() -> None:
    data = json.loads((DOCS / "gpu_fp8_fast_paths_2026-12-02.json").read_text())
    before, after = data["call1"]["rows"], data["call2"]["rows"]

    def ratio(row: dict, kind: str) -> float:
        return TARGETS[kind] / row["tpot_ms"] if kind == "b" else row["output_tokens_per_s"] / TARGETS[kind]

    series = {
        "before (call 1)": [ratio(before[f"{k}_fp8"], k) for k in "abc"],
        "reciprocal, exact accumulation (call 2)": [ratio(after["a_fp8exact"], "a"), float("nan"),
                                                    ratio(after["c_fp8exact"], "c")],
        "reciprocal + fast accumulation: default (call 2)": [ratio(after[f"{k}_fp8"], k) for k in "abc"],
    }  # fmt: skip
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    width = 0.27
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + (i - 1) * width for x in range(3)], values, width, label=name)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(3))
    ax.set_xticklabels(["(a) 512 x 512/256", "(b) batch 1 (1/ms)", "(c) 1000 x 1024/128"])
    ax.set_ylabel("against issue 19's target (1 = met)")
    ax.set_ylim(0.8, 1.15)
    ax.set_title("FP8 on an H200, 8B shape", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax = axes[1]
    silu_before = {r["M"]: r["engine_us"] for r in data["call1"]["fp8_large_m"] if r["op"] == "silu_and_mul_fp8"}
    silu_after = {r["M"]: r["engine_us"] for r in data["call2"]["fp8_large_m"] if r["op"] == "silu_and_mul_fp8"}
    ideal = {r["M"]: r["ideal_us_at_4.15TBps"] for r in data["call2"]["fp8_large_m"] if r["op"] == "silu_and_mul_fp8"}
    tokens = sorted(silu_after)
    for i, (name, values) in enumerate((("divide each value (before)", silu_before), ("times the reciprocal (now)", silu_after),
                                        ("its bytes at 4.15 TB/s", ideal))):  # fmt: skip
        ax.bar([x + (i - 1) * width for x in range(len(tokens))], [values[m] for m in tokens], width, label=name)
    ax.set_xticks(range(len(tokens)))
    ax.set_xticklabels([f"{m:,} tokens" for m in tokens])
    ax.set_yscale("log")
    ax.set_ylabel("µs a call")
    ax.set_title("SiLU-and-multiply with per-token FP8 quantization (14,336 wide)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(DOCS / "gpu_fp8_fast_paths_2026-12-02.png", dpi=110)


if __name__ == "__main__":
    main()
