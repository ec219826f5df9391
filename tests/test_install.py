"""`bash scripts/install.sh` run for real a second time (in CI the suite runs right after the
first install): it must succeed and change nothing, so that it is harmless beside the other
tests (nothing is uninstalled, not even for a moment)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"


def _freeze() -> str:
    return subprocess.run([str(VENV / "bin" / "pip"), "freeze", "--all"], capture_output=True, text=True, check=True,
                          timeout=120).stdout  # fmt: skip


def _state() -> dict[str, int]:
    """When the venv and llmserve's install were last written."""
    found = {"pyvenv.cfg": (VENV / "pyvenv.cfg").stat().st_mtime_ns}
    for path in VENV.glob("lib/python*/site-packages/llmserve-*.dist-info/RECORD"):
        found["llmserve"] = path.stat().st_mtime_ns
    found["script"] = (VENV / "bin" / "llmserve").stat().st_mtime_ns
    return found


@pytest.mark.timeout(600)
def test_a_second_install_succeeds_and_changes_nothing():
    if Path(sys.prefix).resolve() != VENV.resolve():
        pytest.skip("the tests run outside the project's .venv: install.sh would make a new one")
    before, state = _freeze(), _state()
    done = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh")], capture_output=True, text=True, timeout=540,
                          stdin=subprocess.DEVNULL)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert ".venv exists: kept" in done.stdout and "install.sh: done" in done.stdout
    assert _freeze() == before
    assert _state() == state  # the venv not made again, llmserve not installed again
