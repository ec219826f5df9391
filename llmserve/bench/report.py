"""Numbers to reports: summary statistics, vLLM-style text tables, JSON files.

Tables use the layout of `vllm bench` ("===== Title =====", 40-column labels), so a
result can be read next to a vLLM one line by line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

WIDTH = 50


def parse_percentiles(text: str) -> list[float]:
    """ "50,90,99" -> [50.0, 90.0, 99.0]; each must be in (0, 100]."""
    values = [float(p) for p in text.split(",") if p.strip()]
    if not values or any(not 0 < p <= 100 for p in values):
        raise ValueError(f"percentiles must be a comma-separated list in (0, 100], got {text!r}")
    return values


def percentile_word(p: float) -> str:
    """99.0 -> "99", 99.9 -> "99.9": the spelling used in keys and labels."""
    return str(int(p)) if float(p).is_integer() else str(p)


def summarize(values: Sequence[float], percentiles: Iterable[float], name: str, scale: float = 1.0) -> dict[str, float]:
    """mean/median/std/pXX of `values` * scale, keyed as vLLM keys them (`mean_ttft_ms`).

    Empty input gives zeros rather than NaN, so the JSON stays valid."""
    arr = np.asarray(values, dtype=np.float64) * scale
    empty = arr.size == 0
    out = {
        f"mean_{name}": 0.0 if empty else float(arr.mean()),
        f"median_{name}": 0.0 if empty else float(np.median(arr)),
        f"std_{name}": 0.0 if empty else float(arr.std()),
    }
    for p in percentiles:
        out[f"p{percentile_word(p)}_{name}"] = 0.0 if empty else float(np.percentile(arr, p))
    return out


def banner(title: str, fill: str = "=") -> str:
    return f"{' ' + title + ' ' if title else '':{fill}^{WIDTH}}"


def row(label: str, value: object) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<40} {text:<10}"


def metric_rows(
    summary: dict[str, float], name: str, label: str, percentiles: Iterable[float], unit: str = "ms"
) -> list[str]:
    """The Mean/Median/Pxx lines of one metric, read from a `summarize` dict."""
    key = f"{name}_{unit}"
    lines = [
        row(f"Mean {label} ({unit}):", summary[f"mean_{key}"]),
        row(f"Median {label} ({unit}):", summary[f"median_{key}"]),
    ]
    for p in percentiles:
        word = percentile_word(p)
        lines.append(row(f"P{word} {label} ({unit}):", summary[f"p{word}_{key}"]))
    return lines


def write_json(path: str | Path, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
