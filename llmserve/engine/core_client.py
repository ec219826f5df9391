"""Front-side handle on the engine core process: start it, send to it, hear from it."""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import zmq

from llmserve.config import EngineConfig
from llmserve.engine.core_process import run_engine_core
from llmserve.engine.ipc import Kind, Message
from llmserve.errors import EngineDeadError  # noqa: F401 - re-exported
from llmserve.processes import start_spawned

logger = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    """The engine core could not start; the message carries its reason."""


class CoreClient:
    """Starts the core process and moves pickled messages to and from it.

    `on_message` is called from a background thread for every message from the core;
    `on_dead` once, from a background thread, if the process exits unexpectedly.
    """

    def __init__(
        self,
        config: EngineConfig,
        on_message: Callable[[Kind, Any], None],
        on_dead: Callable[[str], None],
        start_timeout: float = 900.0,
    ) -> None:
        self.on_message = on_message
        self.on_dead = on_dead
        self._closing = False
        self._dead_reason: str | None = None
        self._ipc_dir = tempfile.mkdtemp(prefix="llmserve-")
        input_addr = f"ipc://{self._ipc_dir}/input"
        output_addr = f"ipc://{self._ipc_dir}/output"
        self.ctx = zmq.Context()
        self.in_sock = self.ctx.socket(zmq.PUSH)
        self.in_sock.bind(input_addr)
        self.out_sock = self.ctx.socket(zmq.PULL)
        self.out_sock.bind(output_addr)
        self._send_lock = threading.Lock()
        mp = multiprocessing.get_context("spawn")
        # a daemon process may not start processes: with tensor-parallel workers the core
        # is a plain child, stopped by `shutdown` (registered at exit too)
        single = config.tensor_parallel_size * config.pipeline_parallel_size == 1
        self.proc = mp.Process(
            target=run_engine_core, args=(config, input_addr, output_addr),
            name="llmserve-engine-core", daemon=single,
        )  # fmt: skip
        start_spawned(self.proc)
        if not single:
            atexit.register(self.shutdown)
        try:
            self.ready_info = self._wait_ready(start_timeout)
        except BaseException:
            self._stop_process()
            self._close_sockets()
            raise
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name="core-output")
        self._reader.start()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="core-watch")
        self._watcher.start()

    def _wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self.out_sock, zmq.POLLIN)
        while time.monotonic() < deadline:
            if poller.poll(200):
                msg = pickle.loads(self.out_sock.recv())
                if msg.kind is Kind.READY:
                    return msg.payload
                if msg.kind is Kind.ERROR:
                    raise EngineStartError(f"engine core failed to start: {msg.payload}")
            elif not self.proc.is_alive():
                raise EngineStartError(f"engine core exited during start-up (exit code {self.proc.exitcode})")
        raise EngineStartError(f"engine core not ready after {timeout:.0f} s")

    def send(self, kind: Kind, payload: Any = None) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        data = pickle.dumps(Message(kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.in_sock.send(data)

    @property
    def alive(self) -> bool:
        return self._dead_reason is None and self.proc.is_alive()

    def _read_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.out_sock, zmq.POLLIN)
        while not self._closing:
            try:
                if not poller.poll(200):
                    continue
                msg = pickle.loads(self.out_sock.recv())
            except zmq.ZMQError:
                return
            if msg.kind is Kind.ERROR:
                self._mark_dead(f"engine core failed: {msg.payload}")
                continue
            try:
                self.on_message(msg.kind, msg.payload)
            except Exception:  # noqa: BLE001 - this thread must outlive any one bad message
                logger.exception("error handling a message from the engine core")

    def _watch(self) -> None:
        wait([self.proc.sentinel])
        if not self._closing:
            self.proc.join(timeout=1.0)  # reaped, so its exit code (or signal) is known
            code = self.proc.exitcode
            how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited (exit code {code})"
            self._mark_dead(f"engine core process {how}")

    def _mark_dead(self, reason: str) -> None:
        if self._dead_reason is None:
            self._dead_reason = reason
            logger.error(reason)
            self.on_dead(reason)

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.shutdown)  # registered only with tensor-parallel workers
        if self.proc.is_alive():
            try:
                with self._send_lock:
                    self.in_sock.send(pickle.dumps(Message(Kind.SHUTDOWN)), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._stop_process(timeout)
        self._close_sockets()

    def _stop_process(self, timeout: float = 5.0) -> None:
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(2.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

    def _close_sockets(self) -> None:
        reader = getattr(self, "_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join(2.0)  # the reader owns out_sock while it runs
        self.in_sock.close(linger=0)
        self.out_sock.close(linger=0)
        self.ctx.term()
        if os.path.isdir(self._ipc_dir):
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
