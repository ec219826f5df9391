"""A model's device memory and the budget the models share."""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


@dataclass(frozen=True)
class Footprint:
    """What a resident model holds on its device: `total` comes and goes with sleep; the
    `overhead_bytes` (graph pools, buffers: an engine's memory outside its weights and KV
    cache) stay while it sleeps."""

    weight_bytes: int
    kv_cache_bytes: int
    overhead_bytes: int = 0

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes

    @classmethod
    def from_row(cls, row: dict) -> Footprint:
        """From an engine's `memory_footprint()` (or a server's /footprint answer)."""
        return cls(int(row["weight_bytes"]), int(row["kv_cache_bytes"]), int(row.get("overhead_bytes") or 0))


def parse_budget(value: int | float | str, device_total: int | None = None) -> int:
    """Bytes from a budget setting: an integer of bytes, a fraction in (0, 1] or a percentage
    of `device_total`, or a size such as "12GiB" or "512 MB"."""
    if isinstance(value, bool):
        raise ValueError(f"gpu_memory_budget must be bytes, a fraction or a size, got {value!r}")
    if isinstance(value, str) and value.strip().endswith("%"):
        return parse_budget(float(value.strip()[:-1]) / 100, device_total)
    if isinstance(value, float) or (isinstance(value, int) and value <= 1):
        if not 0 < value <= 1:
            raise ValueError(f"a gpu_memory_budget fraction must be in (0, 1], got {value}")
        if device_total is None:
            raise ValueError("a gpu_memory_budget fraction needs the device's memory size")
        return int(value * device_total)
    if isinstance(value, int):
        return value
    match = _SIZE.match(str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"gpu_memory_budget {value!r} is not bytes, a fraction, a percentage or a size like 12GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
