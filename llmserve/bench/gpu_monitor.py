"""GPU utilisation and memory over a benchmark run, sampled by NVML on a thread.

NVML through `pynvml` (the nvidia-ml-py package) when it imports, else `nvidia-smi` in a
loop; on a machine without either (a CPU) the monitor records nothing and reports None.
Utilisation is NVML's: the share of the sample period in which a kernel ran on the GPU.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class GpuUsage:
    gpus: list[int]
    samples: int
    utilization_mean_pct: float
    utilization_max_pct: float
    memory_used_max_gib: float
    memory_total_gib: float

    def as_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        return (f"GPU {','.join(map(str, self.gpus))}: utilisation mean {self.utilization_mean_pct:.0f} %, "
                f"max {self.utilization_max_pct:.0f} %; memory used at most {self.memory_used_max_gib:.1f} "
                f"of {self.memory_total_gib:.1f} GiB ({self.samples} samples)")  # fmt: skip


def _nvml_reader(gpus: list[int]):
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in gpus]
    except Exception:  # noqa: BLE001 - no driver, no device: nothing to monitor
        return None

    def read() -> list[tuple[float, float, float]]:
        out = []
        for h in handles:
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            out.append((float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu), mem.used / 2**30, mem.total / 2**30))
        return out

    return read


def _smi_reader(gpus: list[int]):
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    cmd = [smi, "--query-gpu=utilization.gpu,memory.used,memory.total", "--format=csv,noheader,nounits",
           "-i", ",".join(map(str, gpus))]  # fmt: skip

    def read() -> list[tuple[float, float, float]]:
        text = subprocess.run(cmd, capture_output=True, text=True, timeout=5, check=True).stdout
        rows = [line.split(",") for line in text.strip().splitlines()]
        return [(float(u), float(used) / 1024, float(total) / 1024) for u, used, total in rows]

    try:
        read()
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return read


class GpuMonitor:
    """`with GpuMonitor([0]) as mon: ...` then `mon.usage()`."""

    def __init__(self, gpus: list[int] | None = None, interval_s: float = 0.1) -> None:
        self.gpus = gpus or [0]
        self.interval_s = interval_s
        self._rows: list[list[tuple[float, float, float]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GpuMonitor:
        read = _nvml_reader(self.gpus) or _smi_reader(self.gpus)
        if read is not None:
            self._thread = threading.Thread(target=self._run, args=(read,), daemon=True, name="gpu-monitor")
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self, read) -> None:
        while not self._stop.is_set():
            try:
                self._rows.append(read())
            except Exception:  # noqa: BLE001 - a failed sample is skipped, the run goes on
                pass
            self._stop.wait(self.interval_s)

    def usage(self) -> GpuUsage | None:
        if not self._rows:
            return None
        util = [u for row in self._rows for u, _, _ in row]
        return GpuUsage(self.gpus, len(self._rows), round(sum(util) / len(util), 1), max(util),
                        round(max(used for row in self._rows for _, used, _ in row), 2),
                        round(max(total for row in self._rows for _, _, total in row), 2))  # fmt: skip


def engine_gpus(llm, visible: str | None = None) -> list[int]:
    """The GPUs an engine runs on, as NVML numbers them: the first tensor-parallel-size of
    `visible` (CUDA_VISIBLE_DEVICES, when it lists numbers); [] on a CPU."""
    if llm.config.device != "cuda":
        return []
    size = llm.config.tensor_parallel_size
    listed = [int(x) for x in (visible or "").split(",") if x.strip().isdigit()]
    return listed[:size] if len(listed) >= size else list(range(size))


def monitor_for(llm) -> GpuMonitor | None:
    import os

    gpus = engine_gpus(llm, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return GpuMonitor(gpus) if gpus else None
