"""Headless Debian chromium driven over the Chrome DevTools protocol (one page, one socket)."""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import subprocess
import time
from pathlib import Path

import httpx
from server_utils import stop_process
from websockets.sync.client import connect

# the flags this machine needs: no sandbox as root, and nothing that reaches for the network
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--remote-debugging-port=0", "--remote-allow-origins=*",
]  # fmt: skip


class Browser:
    """`chromium` showing `url`; `evaluate` runs JavaScript in the page, `screenshot` saves a PNG."""

    def __init__(self, chromium: str, url: str, profile_dir: Path, size: tuple[int, int] = (1280, 900)):
        profile_dir.mkdir(parents=True, exist_ok=True)
        (profile_dir / "DevToolsActivePort").unlink(missing_ok=True)  # a reused profile's is stale
        self.log_path = profile_dir / "chromium.log"
        with open(self.log_path, "w") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [chromium, *FLAGS, f"--user-data-dir={profile_dir}", f"--window-size={size[0]},{size[1]}", url],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        self._closing = contextlib.ExitStack()
        try:
            port = self._devtools_port(profile_dir / "DevToolsActivePort")
            page = next(t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page")
            self.socket = self._closing.enter_context(
                connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=10)
            )
        except BaseException:
            self.close()
            raise
        self._ids = itertools.count(1)

    def _devtools_port(self, path: Path, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited {self.proc.returncode}:\n{self.log_path.read_text()}")
            if path.exists() and path.read_text().strip():
                return int(path.read_text().split()[0])
            time.sleep(0.1)
        raise RuntimeError(f"chromium opened no DevTools port:\n{self.log_path.read_text()}")

    def call(self, method: str, **params) -> dict:
        msg_id = next(self._ids)
        self.socket.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.socket.recv(timeout=30))
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 15.0):
        """Poll a JavaScript expression until it is truthy; return its value."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                value = self.evaluate(expression)
            except RuntimeError:  # the page is not there yet
                value = None
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"not true within {timeout} s: {expression}")

    def screenshot(self, path: Path) -> None:
        png = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(png))

    def close(self) -> None:
        try:
            self._closing.close()
        finally:
            stop_process(self.proc, 10)
