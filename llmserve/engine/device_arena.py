"""Device memory at fixed addresses that can be given back and taken again (sleep mode).

A CUDA graph holds the raw addresses of every tensor it read when captured. If a sleeping
engine frees its weights and KV cache and allocates them again on waking, they land
elsewhere and every graph must be captured again (about 2 s for an 8B model).
An arena instead reserves one range of virtual addresses for the life of the engine and
maps physical memory under it only while awake (the CUDA driver's virtual memory API:
cuMemAddressReserve, cuMemCreate, cuMemMap, cuMemUnmap, called through ctypes). Tensors
that view the arena keep their addresses across a sleep, so the graphs stay valid; only
the contents must be put back.

- `CudaArena`: the real one (a GPU);
- `HostArena`: the reference for a machine without one: its memory stays, and `release`
  overwrites it with NaN-like garbage, so a test sees whatever the wake failed to put back.
"""

from __future__ import annotations

import ctypes
import functools
import weakref

import torch

# CUDA driver API enum values (cuda.h)
_ALLOCATION_TYPE_PINNED = 1
_LOCATION_TYPE_DEVICE = 1
_ACCESS_READWRITE = 3
_GRANULARITY_RECOMMENDED = 1


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]  # fmt: skip


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]  # fmt: skip


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class ArenaError(RuntimeError):
    pass


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    u64, size = ctypes.c_ulonglong, ctypes.c_size_t
    signatures = {
        "cuMemGetAllocationGranularity": [ctypes.POINTER(size), ctypes.POINTER(_AllocationProp), ctypes.c_int],
        "cuMemAddressReserve": [ctypes.POINTER(u64), size, size, u64, u64],
        "cuMemAddressFree": [u64, size],
        "cuMemCreate": [ctypes.POINTER(u64), size, ctypes.POINTER(_AllocationProp), u64],
        "cuMemRelease": [u64],
        "cuMemMap": [u64, size, size, u64, u64],
        "cuMemUnmap": [u64, size],
        "cuMemSetAccess": [u64, size, ctypes.POINTER(_AccessDesc), size],
        "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(text))
        raise ArenaError(f"{what} failed: CUDA error {result} ({(text.value or b'?').decode()})")


class _Interface:
    """What torch.as_tensor reads to view device memory it does not own."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}  # fmt: skip


class CudaArena:
    def __init__(self, nbytes: int, device: torch.device) -> None:
        if nbytes <= 0:
            raise ValueError("an arena holds at least one byte")
        lib = _driver()
        torch.cuda.init()
        torch.cuda.synchronize(device)  # the device's primary context is current on this thread
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self._prop = _AllocationProp(type=_ALLOCATION_TYPE_PINNED, requestedHandleTypes=0,
                                     location=_Location(_LOCATION_TYPE_DEVICE, self.device_index))  # fmt: skip
        granularity = ctypes.c_size_t()
        _check(lib.cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(self._prop),
                                                 _GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity")  # fmt: skip
        step = max(1, granularity.value)
        self.nbytes = nbytes
        self.size = -(-nbytes // step) * step
        address = ctypes.c_ulonglong()
        _check(lib.cuMemAddressReserve(ctypes.byref(address), self.size, step, 0, 0), "cuMemAddressReserve")
        self.address = address.value
        self._handle: int | None = None
        # the memory goes back with the arena (an engine dropped without closing it), not at exit
        self._state = {"address": self.address, "size": self.size, "handle": None, "device": self.device_index}
        self._finalizer = weakref.finalize(self, CudaArena._free, self._state)
        self._finalizer.atexit = False  # at exit the driver takes everything back itself
        self.map()
        self.tensor = torch.as_tensor(_Interface(self.address, nbytes), device=device)
        if self.tensor.data_ptr() != self.address:
            raise ArenaError("torch did not view the arena at its address")

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    def map(self) -> None:
        """Physical memory under the range again (its contents are undefined)."""
        if self._handle is not None:
            return
        lib = _driver()
        torch.cuda.set_device(self.device_index)  # the driver calls act on this thread's current context
        handle = ctypes.c_ulonglong()
        _check(lib.cuMemCreate(ctypes.byref(handle), self.size, ctypes.byref(self._prop), 0), "cuMemCreate")
        try:
            _check(lib.cuMemMap(self.address, self.size, 0, handle.value, 0), "cuMemMap")
        except ArenaError:
            lib.cuMemRelease(handle.value)
            raise
        access = _AccessDesc(location=_Location(_LOCATION_TYPE_DEVICE, self.device_index), flags=_ACCESS_READWRITE)
        try:
            _check(lib.cuMemSetAccess(self.address, self.size, ctypes.byref(access), 1), "cuMemSetAccess")
        except ArenaError:  # undone, so a later map() starts clean
            lib.cuMemUnmap(self.address, self.size)
            lib.cuMemRelease(handle.value)
            raise
        self._handle = self._state["handle"] = handle.value

    def release(self) -> None:
        """Give the physical memory back; the addresses stay reserved (nothing may touch them)."""
        if self._handle is None:
            return
        torch.cuda.synchronize(self.device_index)
        lib = _driver()
        _check(lib.cuMemUnmap(self.address, self.size), "cuMemUnmap")
        _check(lib.cuMemRelease(self._handle), "cuMemRelease")
        self._handle = self._state["handle"] = None

    def close(self) -> None:
        """Memory and addresses back (no tensor viewing the arena may be used after)."""
        if self._handle is not None:
            torch.cuda.synchronize(self.device_index)
        self._finalizer()
        self._handle = None

    @staticmethod
    def _free(state: dict) -> None:
        lib = _driver()
        try:  # collected on any thread: make the arena's device current there
            torch.cuda.set_device(state["device"])
        except Exception:  # noqa: BLE001 - CUDA already torn down: the process's exit frees all
            return
        if state["handle"] is not None:
            lib.cuMemUnmap(state["address"], state["size"])
            lib.cuMemRelease(state["handle"])
            state["handle"] = None
        if state["address"]:
            lib.cuMemAddressFree(state["address"], state["size"])
            state["address"] = 0


class HostArena:
    """The reference: ordinary memory whose `release` scrambles the contents."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        if nbytes <= 0:
            raise ValueError("an arena holds at least one byte")
        self.nbytes = self.size = nbytes
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.address = self.tensor.data_ptr()
        self.mapped = True

    def map(self) -> None:
        self.mapped = True

    def release(self) -> None:
        self.tensor.fill_(0xFF)  # NaN in every float type: a value the wake did not restore shows
        self.mapped = False

    def close(self) -> None:
        self.mapped = False


def make_arena(nbytes: int, device: torch.device) -> CudaArena | HostArena:
    return CudaArena(nbytes, device) if device.type == "cuda" else HostArena(nbytes, device)
