"""The one table of a `run_offline_bench.sh` call: every result in $OUT (kernel checks,
(a), (b), (c), the HF baseline, the GPU tests (gpu_tests.xml), (d) runs if present) against the GPU
issue's targets (vLLM 0.25's anchors on this H200), as ratios.

    python3 scripts/gpu/summary.py OUT_DIR     (prints the table; writes OUT_DIR/summary.md)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# the GPU issue's anchors and targets
A_TARGET, A_HF_RATIO, B_TARGET_MS, C_TARGET = 10_150.0, 5.0, 4.9, 3_750.0
D_TTFT_P99_MS, D_TPOT_P99_MS, D_UNLIMITED = 99.0, 9.6, 8_436.0
HF_ANCHOR = 1_918.0


def _load(out: Path, name: str) -> dict | None:
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None


def rows(out: Path) -> list[tuple[str, str, str, str]]:
    """(workload, result, target, ratio) for each result found in `out`."""
    table = []
    kernels = _load(out, "kernels.json")
    if kernels is not None:
        checks = kernels.get("checks", [])
        ok = sum(1 for c in checks if c.get("ok"))
        table.append(
            (
                "kernels vs PyTorch references",
                f"{ok}/{len(checks)} within tolerance",
                "all",
                "ok" if checks and ok == len(checks) else "FAIL",
            )
        )
    a, hf = _load(out, "a.json"), _load(out, "hf.json")
    if a is not None:
        tps = a["output_tokens_per_s"]
        table.append(("(a) 512 x 512/256, output tok/s", f"{tps:,.1f}", f">= {A_TARGET:,.0f}", f"{tps / A_TARGET:.2f}"))
        table.append(("(a) engine ready (s)", f"{a.get('startup_s', float('nan')):.1f}", "vLLM ~61", ""))
        if hf is not None:
            base = hf["output_tokens_per_s"]
            table.append(("HF generate() on (a), same call", f"{base:,.1f}", "", ""))
            table.append(
                (
                    "(a) / HF of the same call",
                    f"{tps / base:.2f}x",
                    f">= {A_HF_RATIO:.0f}x",
                    f"{tps / base / A_HF_RATIO:.2f}",
                )
            )
        table.append(("(a) / HF anchor (1,918 tok/s)", f"{tps / HF_ANCHOR:.2f}x", "", ""))
    b = _load(out, "b.json")
    if b is not None and b.get("tpot_ms") is not None:
        table.append(
            (
                "(b) batch 1, 512/256: ms per output token",
                f"{b['tpot_ms']:.2f}",
                f"<= {B_TARGET_MS}",
                f"{B_TARGET_MS / b['tpot_ms']:.2f}",
            )
        )
        table.append(("(b) TTFT, median (ms)", f"{b['ttft_ms']:.1f}", "", ""))
    c = _load(out, "c.json")
    if c is not None:
        tps = c["output_tokens_per_s"]
        table.append(
            ("(c) 1000 x 1024/128, output tok/s", f"{tps:,.1f}", f">= {C_TARGET:,.0f}", f"{tps / C_TARGET:.2f}")
        )
    if (out / "gpu_tests.xml").is_file():  # the GPU tier's JUnit report (`pytest -m gpu --junitxml`)
        import xml.etree.ElementTree as ET

        suites = ET.parse(out / "gpu_tests.xml").getroot().iter("testsuite")
        n, bad, skipped = 0, 0, 0
        for s in suites:
            n += int(s.get("tests", 0))
            bad += int(s.get("failures", 0)) + int(s.get("errors", 0))
            skipped += int(s.get("skipped", 0))
        table.append(
            (
                "GPU tests (pytest -m gpu)",
                f"{n - bad - skipped}/{n} passed, {skipped} skipped",
                "all",
                "ok" if n and not bad else "FAIL",
            )
        )
    for path in sorted(out.glob("d_rate16*.json")):
        if (d := _load(out, path.name)) is None:
            continue
        table.append(
            (
                f"(d) 16 req/s TTFT p99 ms ({path.stem})",
                f"{d['p99_ttft_ms']:.1f}",
                f"<= {D_TTFT_P99_MS:.0f}",
                f"{D_TTFT_P99_MS / d['p99_ttft_ms']:.2f}",
            )
        )
        table.append(
            (
                f"(d) 16 req/s TPOT p99 ms ({path.stem})",
                f"{d['p99_tpot_ms']:.2f}",
                f"<= {D_TPOT_P99_MS}",
                f"{D_TPOT_P99_MS / d['p99_tpot_ms']:.2f}",
            )
        )
        if srv := d.get("server_metrics"):  # the server's /metrics: where the client's mean TTFT went
            parts = [f"{srv[k]:.1f}" if k in srv else "-" for k in ("mean_ttft_ms", "mean_queue_ms", "mean_prefill_ms")]
            table.append(
                (
                    f"(d) server side: mean TTFT / queue / prefill ms ({path.stem})",
                    " / ".join(parts),
                    f"client mean TTFT {d['mean_ttft_ms']:.1f}",
                    "",
                )
            )
    for path in sorted(out.glob("d_rateinf*.json")):
        if (d := _load(out, path.name)) is None:
            continue
        tps = d["output_throughput"]
        table.append(
            (
                f"(d) unlimited, output tok/s ({path.stem})",
                f"{tps:,.1f}",
                f">= {D_UNLIMITED:,.0f}",
                f"{tps / D_UNLIMITED:.2f}",
            )
        )
    return table


def markdown(table: list[tuple[str, str, str, str]]) -> str:
    lines = ["| workload | result | target | ratio |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {w} | {r} | {t} | {x} |" for w, r, t, x in table]
    return "\n".join(lines) + "\n"


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    text = markdown(rows(out))
    (out / "summary.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
