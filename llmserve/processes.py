"""Child processes: ending one politely, then firmly."""

from __future__ import annotations

import contextlib
import multiprocessing.process
import subprocess
import sys
from collections.abc import Iterator


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


@contextlib.contextmanager
def _main_script_hidden() -> Iterator[None]:
    """While a spawned child starts, the parent's main script is not named to it.

    multiprocessing's spawn makes the child run the parent's main script again (so that
    functions defined there can be found). llmserve's children (the engine core, the
    tensor-parallel workers) run llmserve's own functions on plain data and need nothing
    from it; running it again fails for a script read from standard input (`python -`:
    FileNotFoundError '<stdin>') and re-runs a script without an `if __name__ == "__main__":`
    guard. With the script's path hidden, the child starts as it does under `python -c`."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    by_name = getattr(getattr(main, "__spec__", None), "name", None)  # `python -m pkg`: imported by name, guarded
    if main is None or path is None or by_name is not None:
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def start_spawned(process: multiprocessing.process.BaseProcess) -> None:
    """Start a process of the spawn context without re-running the parent's main script."""
    with _main_script_hidden():
        process.start()
