"""`llmserve up`'s watchdog: a dead model backend is reloaded, a dead Triton server restarted.

Triton keeps reporting a Python-backend model READY after its stub process died (killed, out
of memory): every request to it then fails with "Stub process ... is not healthy" until
someone unloads and loads it. The watchdog looks every `interval_s` for the stub processes of
each READY model of our repository (in /proc); an instance seen before, or every instance of
a Python-backend model, missing on two looks in a row is a dead backend, and the model is
restarted (unload, then load). A server
that exited is started again on the same ports with the same models. After `max_restarts`
restarts within `window_s` it gives up: `gave_up` is set and `on_give_up` called, so that the
platform exits non-zero and its supervisor takes over.

It runs in one long-lived thread: Triton started from it gets SIGTERM when that thread ends
(`stop_with_parent`), so it must be the thread that lives as long as the platform.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from llmserve.triton import control
from llmserve.triton.server import TritonServer

logger = logging.getLogger("llmserve.up")

STUB_BINARY = "triton_python_backend_stub"


def stub_instances(repository: Path, proc_root: str = "/proc") -> dict[str, set[str]]:
    """The live Python-backend stubs of the models in `repository`: {model: {instance name}}.

    A stub's command line is the stub binary, the model's `<repo>/<model>/<version>/model.py`,
    ..., the instance name (e.g. chat_0_0) and the runtime; a zombie's command line is empty."""
    prefix = str(repository.resolve()) + os.sep
    found: dict[str, set[str]] = {}
    for pid in os.listdir(proc_root):
        if not pid.isdigit():
            continue
        try:
            with open(os.path.join(proc_root, pid, "cmdline"), "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if len(argv) < 3 or not argv[0].endswith(STUB_BINARY) or not argv[1].startswith(prefix):
            continue
        parts = Path(argv[1][len(prefix) :]).parts  # model, version, model.py
        args = [a for a in argv if a]
        if len(parts) == 3 and len(args) >= 3:
            found.setdefault(parts[0], set()).add(args[-2])
    return found


@dataclass
class Watchdog:
    triton: TritonServer
    interval_s: float = 1.0
    max_restarts: int = 5
    window_s: float = 600.0
    unload_wait_s: float = 3.0  # a dead stub's streams never finish: the unload does not wait for them
    after_server_restart: Callable[[], None] | None = None  # e.g. load the placed models again
    on_backend_dead: Callable[[str], None] | None = None  # a model's backend died: end the calls waiting on it
    on_model_restarted: Callable[[str], None] | None = None  # back, awake (placement may put it to sleep)
    on_give_up: Callable[[], None] | None = None
    restarts: list[dict] = field(default_factory=list)  # {"what", "model", "at", "seconds"}: for logs and tests
    gave_up: bool = False
    _seen: dict[str, set[str]] = field(default_factory=dict)  # instances seen alive since the model's load
    _missing: dict[str, int] = field(default_factory=dict)  # looks in a row an instance was missing
    _failed: set[str] = field(default_factory=set)  # models whose restart failed: tried again each look
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _recent: deque = field(default_factory=deque)

    def start(self) -> Watchdog:
        self._thread = threading.Thread(target=self._run, name="llmserve-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (before the platform stops Triton itself)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=120)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - one failed look must not end the watch
                logger.exception("watchdog: the check failed; trying again")
            if self.gave_up:
                return

    def check(self) -> None:
        """One look: the server, then each READY model's stubs."""
        proc = self.triton.proc
        if proc is not None and proc.poll() is not None:
            self._restart_server(proc.returncode)
            return
        ready = self._ready_models()
        if ready is None:  # the server does not answer this moment: look again next time
            return
        alive = stub_instances(Path(self.triton.model_repository))
        for model in sorted(self._failed):  # a restart that failed (the load ran out of memory...)
            if model in ready and alive.get(model):
                self._failed.discard(model)  # back after all (an operator loaded it)
            else:
                self._restart_model(model, [])
                return
        for model in list(self._seen):
            if model not in ready:  # unloaded (by an operator, or being reloaded): forget it
                self._seen.pop(model)
                self._missing.pop(model, None)
        for model in ready:
            now = alive.get(model, set())
            lost = self._seen.get(model, set()) - now
            if not now and self._has_stubs(model):  # a Python-backend model READY with no stub at all
                lost = lost or {f"every {model} stub"}  # (it died before a look saw it)
            if lost:
                self._missing[model] = self._missing.get(model, 0) + 1
                if self._missing[model] >= 2:
                    self._restart_model(model, sorted(lost))
                continue
            self._missing.pop(model, None)
            self._seen.setdefault(model, set()).update(now)

    def _has_stubs(self, model: str) -> bool:
        """Whether `model` runs on the Python backend (a stub process per instance while READY)."""
        return any(Path(self.triton.model_repository, model).glob("*/model.py"))

    def _ready_models(self) -> set[str] | None:
        try:
            return control.ready_models(self.triton.url)
        except Exception:  # noqa: BLE001 - unreachable for now (starting, or dying: the next look sees it)
            return None

    def _allowed(self) -> bool:
        now = time.monotonic()
        while self._recent and now - self._recent[0] > self.window_s:
            self._recent.popleft()
        if len(self._recent) >= self.max_restarts:
            logger.critical("watchdog: %d restarts within %.0f s: giving up, the platform stops",
                            len(self._recent), self.window_s)  # fmt: skip
            self.gave_up = True
            if self.on_give_up is not None:
                self.on_give_up()
            return False
        self._recent.append(now)
        return True

    def _restart_model(self, model: str, lost: list[str]) -> None:
        if not self._allowed():
            return
        if lost:
            logger.warning("watchdog: the %s model's backend died (%s gone): restarting it", model, ", ".join(lost))
            if self.on_backend_dead is not None:
                self.on_backend_dead(model)
        else:
            logger.warning("watchdog: restarting %s again", model)
        start = time.monotonic()
        self._seen.pop(model, None)
        self._missing.pop(model, None)
        try:
            control.restart(self.triton.url, model, wait=self.unload_wait_s)
        except Exception:  # noqa: BLE001 - tried again at the next look (counted against max_restarts)
            logger.exception("watchdog: restarting %s failed; trying again", model)
            self._failed.add(model)
            return
        self._failed.discard(model)
        seconds = time.monotonic() - start
        self.restarts.append({"what": "model", "model": model, "at": time.time(), "seconds": round(seconds, 2)})
        logger.warning("watchdog: %s is back (restarted in %.1f s)", model, seconds)
        if self.on_model_restarted is not None:
            self.on_model_restarted(model)

    def _restart_server(self, code: int | None) -> None:
        if not self._allowed():
            return
        logger.error("watchdog: tritonserver exited with %s: starting it again", code)
        start = time.monotonic()
        self._seen.clear()
        self._missing.clear()
        self._failed.clear()  # the new server loads every model anew
        self.triton.restart()
        try:
            self.triton.wait_ready(timeout=600)
            if self.after_server_restart is not None:
                self.after_server_restart()
        except Exception:  # noqa: BLE001 - it died again: the next look sees it
            logger.exception("watchdog: the restarted tritonserver did not come up")
            return
        seconds = time.monotonic() - start
        self.restarts.append({"what": "server", "model": None, "at": time.time(), "seconds": round(seconds, 2)})
        logger.warning("watchdog: tritonserver is back (restarted in %.1f s)", seconds)
