"""Each sampling row's throughput as a share of greedy (a) in the same call, before and after:

    python3 scripts/gpu/plot_sampling_ratios.py docs/gpu_issue18_calls_2026-12-06s3.json OUT.png

Reads the calls' `rows` (bench_rows.py's rows.json) from the data file: "before" is call
1s3 (the sampler of 6a8e1e0), "after" the last call holding each row (4s3; logprobs 8s3).
The dashed line is the issue's bar: at most 5 % below greedy."""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROWS = [("topp", "T 0.8, top-k 50, top-p 0.95"), ("topp_only", "T 0.8, top-p 0.95"),
        ("seeded", "T 0.8, top-p 0.95, seed"), ("openai", "T 0.7, top-p 0.9, pres./freq. 0.3"),
        ("minp", "T 0.8, min-p 0.05"), ("presence", "T 0.8, presence 0.5"), ("repetition", "greedy, repetition 1.1"),
        ("frequency", "T 0.8, frequency 0.5"), ("logprobs", "greedy, logprobs 5")]  # fmt: skip


def ratios(calls: list[dict]) -> dict[str, float]:
    """row -> its tokens/s over greedy's of the same call, from the last call that ran it."""
    out = {}
    for call in calls:
        rows = call.get("rows", {})
        if "a" not in rows:
            continue
        for name, _ in ROWS:
            if name in rows:
                out[name] = rows[name]["output_tokens_per_s"] / rows["a"]["output_tokens_per_s"]
    return out


def main() -> None:
    data, png = sys.argv[1], sys.argv[2]
    calls = json.load(open(data))["calls"]
    before = ratios([calls["1s3_more_sampling_rows"]])
    after = ratios([calls["4s3_filtered_race"], calls["8s3_logprob_stats"]])
    names = [n for n, _ in ROWS if n in before or n in after]
    labels = [dict(ROWS)[n] for n in names]
    fig, ax = plt.subplots(figsize=(10, 5))
    ys = range(len(names))
    ax.barh([y + 0.2 for y in ys], [before.get(n, 0) for n in names], height=0.4, label="before (6a8e1e0)", color="#bbbbbb")
    ax.barh([y - 0.2 for y in ys], [after.get(n, 0) for n in names], height=0.4, label="after (676399c / 9e92369)", color="#2a7ab9")
    for y, n in zip(ys, names):
        for dy, table in ((0.2, before), (-0.2, after)):
            if n in table:
                ax.text(table[n] + 0.005, y + dy, f"{table[n]:.3f}", va="center", fontsize=8)
    ax.axvline(0.95, ls="--", color="#c0392b", lw=1, label="5 % below greedy")
    ax.set_yticks(list(ys), labels)
    ax.invert_yaxis()
    ax.set_xlim(0.6, 1.3)
    ax.set_xlabel("output tokens/s as a share of greedy (a) in the same call")
    ax.set_title("Sampling rows on an H100 80GB, 8B shape, 512 x 512/256 (2026-12-06)")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(png)


if __name__ == "__main__":
    main()
