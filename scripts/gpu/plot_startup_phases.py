"""An engine's start-up by phase, one stacked bar a start, from the engine's own log lines kept
in a calls file (`start-up by phase: model 0.4 s, memory profile 5.4 s, ...`):

    python3 scripts/gpu/plot_startup_phases.py docs/gpu_issue18_calls_2026-12-06s4.json \\
        5s4_threaded_warmup_cold_ab docs/gpu_startup_phases_2026-12-06s4_h100.png "TITLE"

The call's "logs" map a log file's name (e.g. cold_1_main.log) to its kept lines; each file with
a phase line is one bar, labelled by its name."""

from __future__ import annotations

import json
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PHASE = re.compile(r"([a-zA-Z][a-zA-Z -]*?) ([0-9.]+) s")


def phases(line: str) -> dict[str, float]:
    """{phase: seconds} of an engine's `start-up by phase: ...` line."""
    return {name.strip(): float(secs) for name, secs in PHASE.findall(line.split("start-up by phase:", 1)[1])}


def main() -> None:
    data, call, png, title = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    logs = json.load(open(data))["calls"][call]["logs"]
    bars = {}
    for name, lines in logs.items():
        found = [phases(line) for line in lines if "start-up by phase:" in line]
        if found:
            bars[name.removesuffix(".log")] = found[0]
    names = list(bars)
    kinds = list(dict.fromkeys(k for b in bars.values() for k in b))
    fig, ax = plt.subplots(figsize=(8, 3.6 + 0.3 * len(names)))
    left = [0.0] * len(names)
    for kind in kinds:
        widths = [bars[n].get(kind, 0.0) for n in names]
        ax.barh(names, widths, left=left, label=kind)
        left = [a + b for a, b in zip(left, widths)]
    for y, total in enumerate(left):
        ax.text(total + 0.4, y, f"{total:.1f} s", va="center")
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the engine's start to ready, by phase")
    ax.set_xlim(0, max(left) * 1.15)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=len(kinds), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print("wrote", png)


if __name__ == "__main__":
    main()
