"""Launch the real Triton Inference Server shipped in the `nvidia-pytriton` wheel.

The binary runs on our own model repository with explicit model control. What it needs
on a machine like ours (see docs/triton.md): a writable copy of the server tree with the
Python backend stub of the running interpreter, the matching libpython first on
LD_LIBRARY_PATH, and this environment's `bin` first on PATH (the stub takes its Python
from there).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

SHM_PREFIX = "triton_python_backend_shm_region_"
_PR_SET_PDEATHSIG = 1


def _terminate_with(parent_pid: int):
    """For Popen's preexec_fn (in the child, before exec): SIGTERM when the parent dies;
    exit at once if it already has. A no-op where prctl does not exist."""
    import ctypes

    def arm() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent_pid:  # the parent died before the signal was armed
            os._exit(1)

    return arm


def triton_home() -> Path:
    """The server tree inside nvidia-pytriton, found without importing pytriton (whose client
    half needs packages the server does not: typer, tritonclient's HTTP extras)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the Triton server needs nvidia-pytriton: pip install 'llmserve[tritonserver]'")
    return Path(next(iter(spec.submodule_search_locations))) / "tritonserver"


def prepare_server_tree(workdir: Path) -> Path:
    """Copy bin/backends/caches to `workdir` and put this Python's backend stub in place."""
    home = triton_home()
    for part in ("bin", "backends", "caches"):
        if (home / part).exists() and not (workdir / part).exists():
            shutil.copytree(home / part, workdir / part, symlinks=True)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = home / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise ValueError(f"nvidia-pytriton ships no Python backend stub for Python {version}")
    shutil.copy2(stub, workdir / "backends" / "python" / "triton_python_backend_stub")
    return workdir


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def server_env() -> dict[str, str]:
    env = os.environ.copy()
    libs = Path(triton_home()).parents[1] / "nvidia_pytriton.libs"
    ld = [sysconfig.get_config_var("LIBDIR") or "", str(libs), env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = ":".join(p for p in ld if p)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    # the models import llmserve: make this very copy importable even when not installed
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


WORKDIR_PREFIX = "llmserve-triton-"  # a server's copy of the Triton tree (~22 MB), in the temp folder
OWNER_FILE = "owner.pid"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def sweep_stale_workdirs() -> list[str]:
    """Remove the temporary server trees whose launching process is gone (it was killed
    before it could clean up); those of live processes, and any without an owner, stay."""
    removed = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), WORKDIR_PREFIX + "*")):
        try:
            owner = int(Path(path, OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if not _pid_alive(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


@dataclass
class TritonServer:
    """A running tritonserver process; `stop()` ends it and removes its shared memory."""

    model_repository: str
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    address: str = "0.0.0.0"  # where its HTTP, gRPC and metrics endpoints listen
    load_models: list[str] = field(default_factory=lambda: ["*"])
    exit_timeout_secs: int = 5
    log_path: str | None = None
    workdir: str | None = None
    proc: subprocess.Popen | None = None
    shm_prefix: str = ""
    # Linux: the server gets SIGTERM when the thread that started it dies, even by SIGKILL
    # (`llmserve up`: no Triton left running after its launcher is gone)
    stop_with_parent: bool = False

    def command(self, tree: Path) -> list[str]:
        cmd = [
            str(tree / "bin" / "tritonserver"),
            f"--model-repository={Path(self.model_repository).resolve()}",
            "--model-control-mode=explicit",
            f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            f"--http-address={self.address}", f"--grpc-address={self.address}",
            f"--metrics-address={self.address}",
            f"--backend-directory={tree / 'backends'}",
            f"--cache-directory={tree / 'caches'}",
            "--pinned-memory-pool-byte-size=0", "--allow-gpu-metrics=false",
            f"--exit-timeout-secs={self.exit_timeout_secs}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]  # fmt: skip
        cmd += [f"--load-model={name}" for name in self.load_models]
        return cmd

    def start(self) -> TritonServer:
        if not self.workdir:
            sweep_stale_workdirs()
            self.workdir = tempfile.mkdtemp(prefix=WORKDIR_PREFIX)
            # whose it is: a launcher killed outright (SIGKILL) cannot remove it; the next one will
            Path(self.workdir, OWNER_FILE).write_text(str(os.getpid()))
        tree = prepare_server_tree(Path(self.workdir))
        # our own prefix, so that cleanup only ever touches this server's regions
        self.shm_prefix = f"{SHM_PREFIX}llmserve{os.getpid()}_{self.http_port}_"
        # a restart appends: the log of the run that died stays above
        out = open(self.log_path, "a" if self.proc is not None else "w") if self.log_path else None
        self.proc = subprocess.Popen(
            self.command(tree), env=server_env(), stdout=out, stderr=subprocess.STDOUT if out else None,
            start_new_session=True, preexec_fn=_terminate_with(os.getpid()) if self.stop_with_parent else None,
        )  # fmt: skip
        return self

    def restart(self) -> TritonServer:
        """Start again after the process exited (it crashed): its stray stubs, shared memory and
        temporary tree are cleaned up first; the same ports, repository and models."""
        self.cleanup()
        if self.workdir and self.workdir.startswith(tempfile.gettempdir()):
            self.workdir = None  # removed by cleanup: start() makes a fresh one
        return self.start()

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.url}/v2/health/ready", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.proc.returncode}{self._log_tail()}")
            if self.is_ready():
                return
            time.sleep(0.3)
        raise RuntimeError(f"tritonserver not ready after {timeout} s{self._log_tail()}")

    def _log_tail(self) -> str:
        if self.log_path and os.path.exists(self.log_path):
            with open(self.log_path) as f:
                return ":\n" + f.read()[-4000:]
        return ""

    def wait(self) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait()
        finally:
            self.cleanup()

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM (Triton drains and unloads), then SIGKILL the process group if it hangs."""
        if self.proc is None:
            return None
        timeout = timeout if timeout is not None else self.exit_timeout_secs + 15
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.cleanup()
        return self.proc.returncode

    def cleanup(self) -> None:
        """Kill stray stubs of this server (its session) and remove its shm regions and tree."""
        if self.proc is not None:
            # give the stubs' own children (the engine core, multiprocessing's resource
            # tracker) a moment to finish their cleanup before anything left is killed
            deadline = time.monotonic() + 5.0
            while _group_alive(self.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _group_alive(self.proc.pid):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self.shm_prefix:
            for path in glob.glob(f"/dev/shm/{self.shm_prefix}*"):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        if self.workdir and self.workdir.startswith(tempfile.gettempdir()):
            shutil.rmtree(self.workdir, ignore_errors=True)
