"""Moved to `llmserve/host_copy.py` (the kernels use it too, and import nothing from the engine);
this name stays for `llmserve/lora/context.py` until its import moves there."""

from llmserve.host_copy import kept_on_device, staged, to_device

__all__ = ["kept_on_device", "staged", "to_device"]
