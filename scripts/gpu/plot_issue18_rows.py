"""Issue 18's rows as ratios to vLLM 0.25's figures (a bar each; throughput rows llmserve/vLLM,
latency rows vLLM/llmserve, so higher is better) from a full-table call's rows.json as kept in a
docs/gpu_issue18_calls_*.json file (default: 2026-12-04's call 3). Writes the PNG named.

    python3 scripts/gpu/plot_issue18_rows.py [DATA CALL PNG TITLE [DEVICE]]   (DEVICE: H200 unless named)
    python3 scripts/gpu/plot_issue18_rows.py docs/gpu_issue18_calls_2026-12-03_session2.json E_full_table \
        docs/gpu_issue18_rows_2026-12-03.png "2026-12-03 (call E)"
"""
import json
import sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
data, call, png, title = (sys.argv[1:5] if len(sys.argv) > 4 else
                          ("docs/gpu_issue18_calls_2026-12-04.json", "3_full_table", "docs/gpu_issue18_rows_2026-12-04.png",
                           "2026-12-04 (call 3)"))
device = sys.argv[5] if len(sys.argv) > 5 else "H200"
d = json.load(open(data))["calls"][call]["now"]
vllm = {"a": 10304, "topp": 9846, "presence": 9984, "repetition": 10038, "prefix": 11117, "c": 3829, "long64": 897,
        "ttft7680": 195, "tpot7680": 5.26, "b": 4.92}
labels = {"a": "(a) greedy", "topp": "top-k/top-p", "presence": "presence pen.", "repetition": "repetition pen.",
          "prefix": "shared prefix", "c": "(c) 1000 x 1024/128", "long64": "64 x 7,680", "ttft7680": "TTFT 7,680", "tpot7680": "ms/token at 7,680", "b": "(b) ms/token"}
names, ratios = [], []
for key, ref in vllm.items():
    if ("ttft7680" if key == "tpot7680" else key) not in d:
        continue
    row = d["ttft7680" if key == "tpot7680" else key]
    if key == "tpot7680":
        r = ref / row["tpot_ms"]
    elif key in ("ttft7680",):
        r = ref / row["ttft_ms"]
    elif key == "b":
        r = ref / row["tpot_ms"]
    else:
        r = row["output_tokens_per_s"] / ref
    names.append(labels[key]); ratios.append(r)
fig, ax = plt.subplots(figsize=(8, 3.6))
bars = ax.bar(names, ratios, color=["tab:green" if r >= 1 else "tab:orange" for r in ratios])
ax.axhline(1.0, color="k", lw=0.8)
ax.set_ylim(0.8, 1.25)
ax.set_ylabel("llmserve / vLLM 0.25 on H200" if device != "H200" else "llmserve / vLLM 0.25 (higher is better)")
ax.set_title(f"{device}, 8B shape, bf16: issue 18's rows, {title}")
for b, r in zip(bars, ratios):
    ax.text(b.get_x() + b.get_width() / 2, r + 0.005, f"{r:.2f}", ha="center", fontsize=8)
plt.xticks(rotation=25, ha="right", fontsize=8)
plt.tight_layout()
plt.savefig(png, dpi=110)
print(list(zip(names, [round(r, 3) for r in ratios])))
