"""The layers' import boundaries (shared/DESIGN.md): the gateway imports nothing from
`llmserve/engine/`, not even through the llmserve modules it imports at module level. Each check
imports the modules in a fresh interpreter and reads sys.modules, so what earlier tests imported
cannot hide a violation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
GATEWAY_MODULES = sorted(f"llmserve.gateway.{p.stem}" for p in (ROOT / "llmserve" / "gateway").glob("*.py")
                         if p.stem != "__init__")  # fmt: skip


def _loaded(*modules: str) -> list[str]:
    """The llmserve modules loaded by importing `modules` in a fresh interpreter."""
    code = (
        f"import json, sys; import {', '.join(modules)}; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('llmserve'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_gateway_imports_nothing_from_the_engine():
    assert "llmserve.gateway.app" in GATEWAY_MODULES
    loaded = _loaded(*GATEWAY_MODULES)
    assert set(GATEWAY_MODULES) <= set(loaded)
    assert [m for m in loaded if m == "llmserve.engine" or m.startswith("llmserve.engine.")] == []


def test_the_shared_errors_module_is_a_leaf():
    assert _loaded("llmserve.errors") == ["llmserve", "llmserve.errors"]
