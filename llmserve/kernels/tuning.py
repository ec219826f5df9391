"""Per-card kernel settings: data, chosen at start from the device.

A kernel module's tunable settings are module-level values (`TUNABLE` lists them): the values in
the code are the heuristic defaults, used on a card never measured. A card's measured values live
in a JSON file named for the card (`card_key`): shipped ones in `llmserve/kernels/tuned/`, a
user's (written by `llmserve tune`) in `~/.cache/llmserve/tuned/`, which wins. `apply(device)`
sets the card's values before the engine warms up, and puts the defaults back for what an earlier
card's file set and this one does not name (two engines of one process on two cards each get
their own); a value no file names is left as it is.

    {"card": "nvidia-h100-80gb-hbm3", "measured": "2026-12-07 ...",
     "settings": {"llmserve.kernels.split_k_gemm": {"SMALL_M_PROGRAMS": 256, ...}, ...}}
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

# module -> its settings a card may tune (an int, a launch config or split-K rule as an object of
# its fields, or a table: the fused MoE's tiles per experts' shape, `_TABLES`);
# the module's own value is the default
TUNABLE: dict[str, tuple[str, ...]] = {
    "llmserve.kernels.split_k_gemm": ("SMALL_TILE_ROWS", "SMALL_M_PROGRAMS", "PROGRAMS", "BF16_STAGES"),
    "llmserve.kernels.fp8_linear": ("SMALL_M_ROWS",),
    "llmserve.kernels.fused_moe": ("TUNED_TILES", "TUNED_DECODE"),
    "llmserve.kernels.int8_linear": ("SPLIT_K_RULE",),
    "llmserve.kernels.w4a16_linear": ("SPLIT_K_RULE",),
    "llmserve.kernels.gguf_linear": ("SPLIT_K_RULE",),
    "llmserve.kernels.paged_attention": (
        "_DECODE_GPU", "_DECODE_GPU_LARGE", "_DECODE_LARGE_PROGRAMS_PER_SM", "_PREFILL_GPU", "_PREFILL_GPU_LONG",
        "LONG_PREFILL_TOKENS", "MIN_TOKENS_PER_SPLIT", "PROGRAMS_PER_SM_TARGET", "MIN_DECODES_TO_SPLIT",
        "FRESH_KERNEL_TOKENS", "SDPA_PREFILL_TOKENS", "SDPA_CHUNK_MIN_TOKENS",
    ),
}  # fmt: skip
SHIPPED_DIR = Path(__file__).parent / "tuned"


def user_dir() -> Path:
    return Path(os.environ.get("LLMSERVE_TUNED_DIR", Path.home() / ".cache" / "llmserve" / "tuned"))


def card_key(device: torch.device | str) -> str:
    """The card's file name: its CUDA name in lower case, words joined by '-' ("cpu" off a GPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


@dataclass(frozen=True)
class CardSettings:
    """What `apply` chose: the card, the file its values came from (None: defaults alone), and
    the values that differ from the defaults."""

    card: str
    source: str | None
    changed: dict[str, dict[str, Any]] = field(default_factory=dict)

    def summary(self) -> str:
        if self.source is None:
            return f"{self.card}: the defaults (no tuned settings for this card; `llmserve tune` writes them)"
        changed = sum(len(v) for v in self.changed.values())
        return f"{self.card}: {self.source} ({changed} setting(s) differ from the defaults)"


def _read_defaults() -> dict[str, dict[str, Any]]:
    out = {}
    for module_name, names in TUNABLE.items():
        module = importlib.import_module(module_name)
        out[module_name] = {name: copy.deepcopy(getattr(module, name)) for name in names}
    return out


_DEFAULTS = _read_defaults()  # each module's own values, as imported
_applied: set[tuple[str, str]] = set()  # the settings the last `apply` took from a card's file


def defaults() -> dict[str, dict[str, Any]]:
    return _DEFAULTS


def settings_file(card: str) -> Path | None:
    """The user's file for the card, else the shipped one, else None."""
    for folder in (user_dir(), SHIPPED_DIR):
        path = folder / f"{card}.json"
        if path.is_file():
            return path
    return None


def read_settings(path: Path) -> dict[str, dict[str, Any]]:
    """A settings file's values as the modules hold them, checked: known modules and names, values
    of the defaults' kinds."""
    data = json.loads(path.read_text())
    settings = data.get("settings") if isinstance(data, dict) else None
    if not isinstance(settings, dict):
        raise ValueError(f"{path}: no 'settings' object")
    out: dict[str, dict[str, Any]] = {}
    for module_name, values in settings.items():
        known = TUNABLE.get(module_name)
        if known is None:
            raise ValueError(f"{path}: unknown kernel module {module_name!r} (tunable: {', '.join(TUNABLE)})")
        if not isinstance(values, dict):
            raise ValueError(f"{path}: {module_name} must map setting names to values")
        for name, value in values.items():
            if name not in known:
                raise ValueError(f"{path}: {module_name} has no tunable setting {name!r} ({', '.join(known)})")
            out.setdefault(module_name, {})[name] = _checked(f"{path}: {module_name}.{name}",
                                                             defaults()[module_name][name], value, module_name, name)  # fmt: skip
    return out


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


# the table settings: (module, name) -> whether it maps shape -> batch bucket -> tiles ("buckets")
# or shape -> settings ("flat"), and the module value whose keys each innermost object must have
_TABLES: dict[tuple[str, str], tuple[str, str]] = {
    ("llmserve.kernels.fused_moe", "TUNED_TILES"): ("buckets", "DEFAULT_TILES"),
    ("llmserve.kernels.fused_moe", "TUNED_DECODE"): ("flat", "DEFAULT_DECODE"),
}
_SHAPE_KEY = re.compile(r"[1-9][0-9]*,[1-9][0-9]*,[1-9][0-9]*")  # "E,H,I" (fused_moe.shape_key)


def _table_fields(module_name: str, source: str) -> list[str]:
    value = getattr(importlib.import_module(module_name), source)
    return list(next(iter(value.values())) if source == "DEFAULT_TILES" else value)


def _checked_fields(where: str, fields: list[str], value: Any) -> dict[str, int]:
    """A table's innermost object: exactly `fields`, non-negative integers, block sizes powers of 2."""
    if not isinstance(value, dict) or set(value) != set(fields) or not all(map(_is_count, value.values())):
        raise ValueError(f"{where} must be an object of non-negative integers {', '.join(fields)}, not {value!r}")
    for name, v in value.items():
        if "BLOCK" in name and not _is_power_of_two(v):
            raise ValueError(f"{where}: {name} must be a power of two, not {v}")
    return {name: value[name] for name in fields}


def _checked_table(where: str, module_name: str, name: str, value: Any) -> dict:
    """A table setting as the module holds it: shape keys "E,H,I"; batch buckets as ints (JSON
    keeps them as digit strings)."""
    kind, source = _TABLES[module_name, name]
    fields = _table_fields(module_name, source)
    if not isinstance(value, dict):
        raise ValueError(f'{where} must be an object of experts\' shapes "E,H,I", not {value!r}')
    out: dict = {}
    for shape, entry in value.items():
        if not isinstance(shape, str) or not _SHAPE_KEY.fullmatch(shape):
            raise ValueError(f'{where}: the key {shape!r} is not an experts\' shape "E,H,I"')
        if kind == "flat":
            out[shape] = _checked_fields(f"{where}[{shape!r}]", fields, entry)
            continue
        if not isinstance(entry, dict) or not entry:
            raise ValueError(f"{where}[{shape!r}] must be an object of batch buckets (token counts), not {entry!r}")
        table = {}
        for bucket, tiles in entry.items():
            count = int(bucket) if isinstance(bucket, str) and bucket.isdigit() else bucket
            if not _is_count(count) or count == 0:
                raise ValueError(f"{where}[{shape!r}]: the batch bucket {bucket!r} is not a positive token count")
            table[count] = _checked_fields(f"{where}[{shape!r}][{count}]", fields, tiles)
        out[shape] = table
    return out


def _checked(where: str, default: Any, value: Any, module_name: str = "", name: str = "") -> Any:
    """A file's value as the module holds it: an int, a launch config from its fields, or a table."""
    if (module_name, name) in _TABLES:
        return _checked_table(where, module_name, name, value)
    if dataclasses.is_dataclass(default):  # (its fields are lower case: no power-of-two BLOCK check applies)
        return type(default)(**_checked_fields(where, [f.name for f in dataclasses.fields(default)], value))
    if not _is_count(value):
        raise ValueError(f"{where} must be a non-negative integer, not {value!r}")
    return value


def as_data(value: Any) -> Any:
    """A setting as its file holds it (a table's keys as strings, as JSON writes them)."""
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(k): as_data(v) for k, v in value.items()}
    return value


def set_values(values: dict[str, dict[str, Any]]) -> None:
    """Set the modules' settings: the defaults, then `values` over them."""
    for module_name, names in defaults().items():
        module = importlib.import_module(module_name)
        for name, value in {**copy.deepcopy(names), **values.get(module_name, {})}.items():
            setattr(module, name, value)


def apply(device: torch.device | str) -> CardSettings:
    """Set the kernels' settings for the card of `device` (a broken file: an error naming it)."""
    card = card_key(device)
    path = settings_file(card)
    values = read_settings(path) if path is not None else {}
    base = defaults()
    # what an earlier card's file set goes back to its default; what no file names stays as it is
    for module_name, name in _applied - {(m, n) for m, names in values.items() for n in names}:
        setattr(importlib.import_module(module_name), name, copy.deepcopy(base[module_name][name]))
    for module_name, names in values.items():
        module = importlib.import_module(module_name)
        for name, value in names.items():
            setattr(module, name, value)
    _applied.clear()
    _applied.update((m, n) for m, names in values.items() for n in names)
    changed = {
        m: {n: v for n, v in names.items() if base[m][n] != v}
        for m, names in values.items()
        if any(base[m][n] != v for n, v in names.items())
    }
    return CardSettings(card, str(path) if path is not None else None, changed)


def write_settings(card: str, values: dict[str, dict[str, Any]], measured: str, folder: Path | None = None) -> Path:
    """Write a card's settings file (atomically: a reader never sees half of it)."""
    folder = folder or user_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{card}.json"
    tmp = path.with_suffix(".json.tmp")
    data = {m: {n: as_data(v) for n, v in names.items()} for m, names in values.items()}
    tmp.write_text(json.dumps({"card": card, "measured": measured, "settings": data}, indent=1, sort_keys=True))
    tmp.replace(path)
    return path
