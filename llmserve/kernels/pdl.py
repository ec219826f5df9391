"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step.

On Hopper and later a kernel launched with PDL may start while the kernel before it on the
stream is still finishing: its programs get scheduled, run what does not depend on the
previous kernel (address arithmetic, loads of constant weights), and wait in
`griddepcontrol.wait` until the previous grid has completed and its writes are visible. At
batch 1 a decode step is a chain of some 300 short kernels (the 8B shape), so the launch and ramp-up of each one, hidden behind the tail of the one before,
is time the step no longer pays. CUDA graphs keep the dependencies (stream capture turns
them into programmatic edges).

Each kernel that takes part has a `USE_GDC: tl.constexpr` parameter and calls `gdc_enter`
before its first load of anything an earlier kernel wrote (and before any store): the wait,
then the signal that lets the next kernel launch. Without PDL (a CPU, the interpreter, a GPU
before Hopper, or `LLMSERVE_PDL=0` for a before/after in one tree) `launch_options` gives
`USE_GDC=False` and the launch is the plain one: the same kernel code, the same results.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("LLMSERVE_PDL", "1") not in ("", "0")  # configuration: read once
_supported: dict[torch.device, bool] = {}  # per device: a fact of the hardware, not state


def _triton_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda as tl_cuda
    except ImportError:  # pragma: no cover - a Triton without the NVIDIA backend
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}) and hasattr(tl_cuda, "gdc_wait")


def pdl_supported(device: torch.device) -> bool:
    """PDL on this device: a CUDA GPU of compute capability 9.0 or more, compiled (not the
    interpreter), with a Triton that knows `launch_pdl`; and not switched off."""
    if not ENABLED or device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    if device not in _supported:
        _supported[device] = torch.cuda.get_device_capability(device)[0] >= 9 and _triton_has_pdl()
    return _supported[device]


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch: `USE_GDC` and, where PDL runs, `launch_pdl`."""
    if pdl_supported(device):
        return {"USE_GDC": True, "launch_pdl": True}
    return {"USE_GDC": False}


@triton.jit
def gdc_enter(USE_GDC: tl.constexpr):
    """Wait for the previous kernel's grid (its writes visible), then let the next kernel launch."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
