"""A model's tensors kept in host memory while its engine sleeps, and put back on waking.

Every tensor is packed into one host buffer (pinned on a GPU, allocated at the first sleep and
reused after), so a sleep is one pass of device-to-host copies and a wake is one host-to-device
copy into one device buffer that the tensors then view. Tensor by tensor through pageable
memory, as first built, an 8B model's sleep took 25.7 s (docs/history/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 256  # bytes: every tensor starts at a multiple, as the device allocator would place it


@dataclass(frozen=True)
class Slot:
    name: str
    offset: int  # bytes into the buffer
    nbytes: int
    shape: torch.Size
    dtype: torch.dtype


class WeightStash:
    def __init__(self) -> None:
        self.host: torch.Tensor | None = None  # uint8, reused from sleep to sleep
        self.slots: list[Slot] = []
        self.nbytes = 0

    def __bool__(self) -> bool:
        return bool(self.slots)

    def stash(self, tensors: dict[str, torch.Tensor], pin: bool) -> None:
        """Copy `tensors` into the host buffer; the caller then frees them on the device."""
        self.slots, offset = [], 0
        for name, tensor in tensors.items():
            nbytes = tensor.numel() * tensor.element_size()
            self.slots.append(Slot(name, offset, nbytes, tensor.shape, tensor.dtype))
            offset += -(-nbytes // ALIGN) * ALIGN
        self.nbytes = offset
        self._reserve_host(pin)
        for slot in self.slots:
            self._view(self.host, slot).copy_(tensors[slot.name], non_blocking=pin)
        if pin:
            torch.cuda.synchronize()

    def _reserve_host(self, pin: bool) -> None:
        """A host buffer of at least `nbytes`: the one kept from before when it is large enough."""
        if self.host is None or self.host.numel() < self.nbytes:
            self.host = None  # the old buffer goes before the larger one is made
            self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)

    def restore(self, device: torch.device) -> dict[str, torch.Tensor]:
        """One device buffer holding every tensor again; returns each tensor's view of it."""
        buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        buffer.copy_(self.host[: self.nbytes], non_blocking=device.type == "cuda")
        views = {slot.name: self._view(buffer, slot) for slot in self.slots}
        self.slots = []
        return views

    def restore_into(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors back in `buffer` (an arena, uint8, at least `nbytes`) at their offsets,
        in one copy; returns each tensor's view of it."""
        buffer[: self.nbytes].copy_(self.host[: self.nbytes], non_blocking=buffer.device.type == "cuda")
        return {slot.name: self._view(buffer, slot) for slot in self.slots}

    def save_whole(self, buffer: torch.Tensor, pin: bool) -> None:
        """Copy `buffer` (laid out as the last stash) to host memory in one copy."""
        self._reserve_host(pin)
        self.host[: self.nbytes].copy_(buffer[: self.nbytes], non_blocking=pin)
        if pin:
            torch.cuda.synchronize()

    def copy_back(self, views: dict[str, torch.Tensor]) -> None:
        """Copy the stashed tensors into existing tensors of the same shapes (`views`)."""
        for slot in self.slots:
            views[slot.name].copy_(self._view(self.host, slot), non_blocking=views[slot.name].device.type == "cuda")

    def release(self) -> None:
        """Give the host buffer back (level 2: nothing is kept)."""
        self.host, self.slots, self.nbytes = None, [], 0

    @staticmethod
    def _view(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
        raw = buffer[slot.offset : slot.offset + slot.nbytes]
        return raw.view(slot.dtype).view(slot.shape) if slot.nbytes else torch.empty(slot.shape, dtype=slot.dtype,
                                                                                      device=buffer.device)  # fmt: skip
