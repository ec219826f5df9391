"""Which adapter holds which of a fixed number of slots, with least-recently-used eviction.

Bookkeeping only (names and slot numbers, no tensors): the store (llmserve/lora/store.py)
writes the weights of the slot this table hands out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

from llmserve.lora.errors import LoRAAdapterError, LoRAErrorKind


@dataclass(frozen=True, slots=True)
class SlotAssignment:
    slot: int
    evicted: str | None  # the adapter that lost this slot, if one did


class SlotTable:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._slots: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    def __contains__(self, name: str) -> bool:
        return name in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def names(self) -> list[str]:
        """Loaded adapters, least recently used first."""
        return list(self._slots)

    def slot_of(self, name: str) -> int:
        """`name`'s slot, marked as just used."""
        if name not in self._slots:
            raise LoRAAdapterError(LoRAErrorKind.NOT_LOADED, f"LoRA adapter {name!r} is not loaded")
        self._slots.move_to_end(name)
        return self._slots[name]

    def assign(self, name: str, protected: Collection[str] = ()) -> SlotAssignment:
        """A slot for `name`: its own if it has one, else a free one, else the least recently
        used adapter's that is not in `protected` (those the running batch uses)."""
        if name in self._slots:
            return SlotAssignment(self.slot_of(name), None)
        if self._free:
            slot, evicted = self._free.pop(), None
        else:
            evicted = next((n for n in self._slots if n not in protected), None)
            if evicted is None:
                raise LoRAAdapterError(LoRAErrorKind.NO_FREE_SLOT,
                                       f"all {self.num_slots} LoRA slots hold adapters in use; {name!r} must wait")  # fmt: skip
            slot = self._slots.pop(evicted)
        self._slots[name] = slot
        return SlotAssignment(slot, evicted)

    def release(self, name: str) -> int:
        """Free `name`'s slot; returns it."""
        if name not in self._slots:
            raise LoRAAdapterError(LoRAErrorKind.NOT_LOADED, f"LoRA adapter {name!r} is not loaded")
        slot = self._slots.pop(name)
        self._free.append(slot)
        return slot
