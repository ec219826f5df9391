"""A request for a LoRA adapter, as vLLM spells it: `LoRARequest(lora_name, lora_int_id, lora_path)`.

Plain data: it travels with each request from the front to the engine core, which reads the
adapter from `lora_path` the first time it sees (name, id) and keeps it in a slot. With
`lora_roots` (a server's --lora-roots), `lora_path` is the resolved path the server checked, and
the core reads that very folder only if it is still inside them (llmserve/lora/folder.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_roots: tuple[str, ...] = ()  # set: the folder (resolved) and its files must be inside these

    def __post_init__(self) -> None:
        if not self.lora_name or not isinstance(self.lora_name, str):
            raise ValueError("lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")

    @property
    def key(self) -> str:
        """What separates this adapter's prefix cache from every other's (and the base's)."""
        return f"lora:{self.lora_name}:{self.lora_int_id}"


def parse_lora_module(spec: str) -> tuple[str, str]:
    """`name=path` (a LoRA adapter served under `name`) -> (name, path); ValueError otherwise."""
    name, sep, path = spec.strip().partition("=")
    if not sep or not name or not path:
        raise ValueError(f"a LoRA module is NAME=PATH, got {spec!r}")
    return name, path
