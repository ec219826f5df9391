"""Adapters in a fixed number of slots, by name: load (evicting the least recently used when
full), unload, and the slot of a name for the batch being built."""

from __future__ import annotations

from collections.abc import Collection

import torch

from llmserve.lora.adapter import LoRAAdapter
from llmserve.lora.slot_table import SlotAssignment, SlotTable
from llmserve.lora.slot_weights import ProjectionLoRA, SlotWeights
from llmserve.model.interface import ModelArch


class LoRASlotStore:
    """`num_slots` adapters of rank up to `max_rank` on `device`, in the model's `dtype`.
    Evicted adapters are dropped from the slots; whoever holds the LoRAAdapter (a CPU cache)
    can load it again."""

    def __init__(self, arch: ModelArch, num_slots: int, max_rank: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", output_major_b: bool = False) -> None:  # fmt: skip
        """`output_major_b`: B laid out for the GEMM form of the expand (SlotWeights)."""
        if max_rank < 1:
            raise ValueError(f"max_rank must be >= 1, got {max_rank}")
        self.table = SlotTable(num_slots)
        self.weights = SlotWeights(arch, num_slots, max_rank, dtype, device, output_major_b)

    @property
    def num_slots(self) -> int:
        return self.table.num_slots

    @property
    def max_rank(self) -> int:
        return self.weights.max_rank

    def load(self, adapter: LoRAAdapter, protected: Collection[str] = ()) -> SlotAssignment:
        """Place `adapter` in a slot (its own again if its name is loaded: the weights are
        rewritten); a full store evicts the least recently used adapter not in `protected`.
        Raises LoRAAdapterError (NO_FREE_SLOT, or the adapter does not fit)."""
        assignment = self.place(adapter, protected)
        self.weights.write(assignment.slot, adapter)
        return assignment

    def place(self, adapter: LoRAAdapter, protected: Collection[str] = ()) -> SlotAssignment:
        """`load` without writing the weights: the adapter checked against the slots, then a slot
        chosen (whoever writes it: every tensor-parallel rank its own share)."""
        self.weights.check(adapter)  # before any slot changes hands
        return self.table.assign(adapter.name, protected)

    def unload(self, name: str) -> None:
        """Free `name`'s slot (LoRAAdapterError NOT_LOADED if it holds none)."""
        self.weights.clear(self.table.release(name))

    def slot_of(self, name: str) -> int:
        """The slot of adapter `name`, marked as just used (LoRAAdapterError NOT_LOADED)."""
        return self.table.slot_of(name)

    def loaded(self) -> list[str]:
        """Adapter names in the slots, least recently used first."""
        return self.table.names()

    def projection(self, name: str, layer: int) -> ProjectionLoRA:
        return self.weights.projection(name, layer)
