"""Child processes: ending one politely, then firmly."""

from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen, timeout: float) -> int:
    """SIGTERM, then SIGKILL after `timeout` seconds; the exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
