"""Host-to-device copies that do not wait for the GPU.

A copy from ordinary (pageable) host memory synchronizes with the stream before it
starts, so every small input tensor made with `torch.tensor(..., device="cuda")` would
wait for the step already running on the GPU — and undo the overlap of host work with
device work. Staging through pinned memory (torch's caching host allocator, which keeps
a block until its copy has completed) makes the copy truly asynchronous.
"""

from __future__ import annotations

import numpy as np
import torch

_NUMPY_DTYPES = {torch.long: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_}


def staged(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (a list, numpy array or CPU tensor) as a host tensor ready to copy to
    `device` without a stream sync: in pinned memory when the device is a GPU."""
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(values)
    elif isinstance(values, torch.Tensor):
        host = values
    elif dtype in _NUMPY_DTYPES:  # a list through numpy: 0.27 ms for 7,680 ints against 0.73 by torch.tensor
        host = torch.from_numpy(np.asarray(values, dtype=_NUMPY_DTYPES[dtype]))
    else:
        host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host if host.dtype == dtype else host.to(dtype)
    # a pinned buffer from torch's caching host allocator, filled: `Tensor.pin_memory()` would first
    # ask the driver whether the source is pinned already, host time on every copy of a step
    pinned = torch.empty(host.shape, dtype=dtype, pin_memory=True)
    pinned.copy_(host)
    return pinned


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` on `device`, without a stream sync."""
    return staged(values, dtype, device).to(device, non_blocking=True)


def kept_on_device(owner, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`owner.<name>` (a list that does not change) on `device`: copied on first use, then kept in
    `owner.copies` (a dict), so a batch's settings cross once while the batch lasts."""
    tensor = owner.copies.get(name)
    if tensor is None:
        tensor = owner.copies[name] = to_device(getattr(owner, name), dtype, device)
    return tensor
