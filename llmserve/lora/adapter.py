"""A LoRA adapter in memory: its A and B matrices per (layer, module), its rank and scaling."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LoRAModuleWeights:
    """delta_W = scaling * b @ a for one base layer."""

    a: torch.Tensor  # [r, in_features] (PEFT's lora_A.weight)
    b: torch.Tensor  # [out_features, r] (PEFT's lora_B.weight)


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """An adapter read and checked against one base model (llmserve/lora/reader.py)."""

    name: str
    path: str
    rank: int
    scaling: float  # lora_alpha / r (rsLoRA: / sqrt(r)), applied to every module
    modules: Mapping[tuple[int, str], LoRAModuleWeights]  # (layer index, PEFT module name) -> A, B

    @property
    def target_modules(self) -> tuple[str, ...]:
        """The PEFT module names this adapter has weights for, sorted."""
        return tuple(sorted({module for _, module in self.modules}))

    @property
    def num_bytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.modules.values())
