"""A LoRA delta added by the op after its projection instead of by a kernel of its own (issue 22,
batch 1).

With the adapter on a second stream (LoRALinear's overlap) the projection's output waits for the
side stream's float32 delta and adds it, `y.add_(delta)`: a kernel of a few µs at one token, on the
critical path of every adapted projection. Three of the four projections of a layer
feed an op that reads their output once, right away: o_proj the post-attention RMSNorm (with the
residual), gate_up the SiLU-and-multiply, down_proj the next layer's input RMSNorm (the model's
final norm after the last layer). Those ops take the delta as one more input and add it as they
load the row (`delta=` of llmserve/kernels/norm.py and activation.py, and of their references in
llmserve/model/layers.py: the same bits as the add), so the add's launch is gone. qkv_proj keeps its
add: its output is split, rotated and cached by several ops.

`DeferredDelta` is the hand-over between one projection and its consumer. The LoRA layer sets it
on every call (its delta, or None when it has already added everything); the consumer takes it,
waiting for the side stream first. The model's code is not touched: `apply_lora` wraps the
consumers as it wraps the projections, and `AppliedLoRA.remove` puts them back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class DeferredDelta:
    def __init__(self, side: torch.cuda.Stream) -> None:
        self.side = side  # the stream the delta is computed on
        self.pending: torch.Tensor | None = None

    def put(self, delta: torch.Tensor | None) -> None:
        self.pending = delta

    def take(self) -> torch.Tensor | None:
        """The delta for the op about to run (None: nothing to add), ready on the current stream."""
        delta, self.pending = self.pending, None
        if delta is not None:
            torch.cuda.current_stream(delta.device).wait_stream(self.side)
        return delta


class NormAddingDelta(nn.Module):
    """An RMSNorm (llmserve/model/layers.py) whose input may come with the deferred LoRA delta of
    the projection before it, added in the norm's own kernel."""

    def __init__(self, norm: nn.Module, deferred: DeferredDelta) -> None:
        super().__init__()
        self.norm = norm
        self.deferred = deferred

    @property
    def weight(self) -> torch.Tensor:  # (read by others: the piecewise graphs take their dtype from it)
        return self.norm.weight

    @property
    def eps(self) -> float:
        return self.norm.eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        delta = self.deferred.take()
        if delta is None:
            return self.norm(x, residual)
        if residual is None:  # (a guard: only the first layer's input norm has none, and it follows no projection)
            raise RuntimeError("a deferred LoRA delta reached a norm without a residual")
        return self.norm.ops.fused_add_rms_norm(x, residual, self.weight, self.eps, delta=delta)

    def fp8(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """`RMSNorm.fp8`. A guard: the model picks it only when the next projection takes FP8
        tokens, and with LoRA every projection is a LoRALinear, which does not; so no delta is
        pending here."""
        if self.deferred.pending is not None:
            raise RuntimeError("a deferred LoRA delta reached the FP8 norm")
        return self.norm.fp8(x, residual)


class ActAddingDelta:
    """The MLP's activation (`silu_and_mul`) taking the gate/up projection's deferred delta."""

    def __init__(self, act: Callable, deferred: DeferredDelta) -> None:
        self.act = act
        self.deferred = deferred

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        delta = self.deferred.take()
        return self.act(h) if delta is None else self.act(h, delta=delta)
