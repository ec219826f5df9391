"""The plot next to docs/history/benchmarks.md's "mixed-step attention, the sampler, first-run compiles"
section: one layer's attention of a mixed step as one launch and as two (bf16 and FP8 caches),
and the FP8 rows of each device call against issue 19's targets.

    python scripts/plots/fast_paths.py   # writes docs/gpu_fast_paths_2026-12-01.png
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs"


def main() -> None:
    att = json.loads((DOCS / "gpu_attn_mixed_call2_2026-12-01.json").read_text())
    rows = [r for r in att if r["prefill_chunks"] == 15 and r["context"][0] == 1024]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    x = range(len(rows))
    kv = {"bfloat16": "bf16 KV", "float8_e4m3fn": "FP8 KV"}
    ax.bar([i - 0.27 for i in x], [r["one_launch_ms"] for r in rows], 0.27, label="one launch (before)")
    ax.bar(list(x), [r.get("two_launches_bf16_dots_ms", float("nan")) for r in rows], 0.27,
           label="two launches, FP8 read back as bf16")  # fmt: skip
    ax.bar([i + 0.27 for i in x], [r["two_launches_ms"] for r in rows], 0.27, label="two launches (now)")
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{kv[r['kv']]}\n{r['decodes']} decodes" for r in rows], fontsize=8)
    ax.set_ylabel("ms, one layer's attention")
    ax.set_title("Mixed step: decodes (context ~1.1k) + 15 chunks of 1,024", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[1]
    calls = {"last session": (14755 / 14600, 5058 / 5650, 3.4 / 3.447), "call 2": (float("nan"), 4832.6 / 5650, 3.4 / 3.404),
             "call 3": (10278.1 / 14600, float("nan"), 3.4 / 3.386), "call 5": (11723.2 / 14600, 5438.4 / 5650, 3.4 / 3.395)}  # fmt: skip
    for i, (name, values) in enumerate(calls.items()):
        ax.bar([j + (i - 1.5) * 0.2 for j in range(3)], values, 0.2, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(3))
    ax.set_xticklabels(["(a) tok/s / 14,600", "(c) tok/s / 5,650", "3.4 ms / (b) ms"], fontsize=8)
    ax.set_ylim(0.6, 1.1)
    ax.set_title("FP8 rows against issue 19's targets (1.0 = met; (a) in calls 3, 5: first run, compiling)", fontsize=9)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(DOCS / "gpu_fast_paths_2026-12-01.png", dpi=110)


if __name__ == "__main__":
    main()
