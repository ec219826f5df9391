"""LoRA on a model at run time, without touching the model's code: each decoder layer's linear
layers that take adapters (its family's `LinearSpec`s: Llama's qkv_proj, o_proj, gate_up_proj and
down_proj) is replaced by a LoRALinear that calls
the original layer, then adds each token's adapter delta read from the slot store, for the
token -> slot mapping of the step held by a shared LoRAContext.

The original layer becomes the wrapper's `base_layer` (PEFT's name for it), so parameter
names gain `.base_layer`: load weights before applying, or `remove()` first. A wrapped FP8
layer takes unquantized activations (the fused norm/activation quantization is skipped for
it, since `takes_fp8_tokens` sees a LoRALinear): the adapter must see the real input.
Under tensor parallelism the store holds each rank's share (lora/shard.py), and the
row-parallel layers sum their shrink outputs over the ranks before the expand.
In overlapped steps the delta of o_proj, gate_up_proj and down_proj is added by the op after
each (lora/deferred.py; the model names those ops: `lora_consumers`): those norms and the
activation are wrapped too, and their parameter names gain `.norm` while LoRA is applied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from llmserve.lora.context import LoRAContext
from llmserve.lora.deferred import ActAddingDelta, DeferredDelta, NormAddingDelta
from llmserve.lora.ops import REFERENCE_LORA_OPS, LoRAOps
from llmserve.lora.projections import row_parallel
from llmserve.lora.slot_weights import ProjectionLoRA
from llmserve.lora.store import LoRASlotStore
from llmserve.model.interface import CausalLM
from llmserve.model.registry import family_of


class LoRALinear(nn.Module):
    """base_layer(x) + for each token t with slot s: scaling[s] * (x_t @ A[s]^T) @ B[s]^T, slice by
    slice of a fused projection.

    With `side` (a second CUDA stream) and at most `ops.overlap_max_tokens` rows, the adapter's
    shrink and expand run on `side` into a zeroed float32 buffer while the base GEMM runs, and
    the buffer is added to the GEMM's output after both: at batch 1 the two LoRA kernels are a few
    µs of launch-bound latency each, hidden behind the GEMM's 12-30 µs. The sum is the same as
    the expand's in place (y rounded once from y + delta in float32). With `deferred` (set by
    apply_lora for o, gate/up and down) the layer returns y without the delta and hands the
    buffer to the op after it, which adds it with the same rounding (lora/deferred.py)."""

    def __init__(self, base_layer: nn.Module, lora: ProjectionLoRA, context: LoRAContext, ops: LoRAOps,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 side: torch.cuda.Stream | None = None) -> None:  # fmt: skip
        super().__init__()
        self.base_layer = base_layer
        self.lora = lora  # views of the store's tensors: not parameters, not in the state dict
        self.context = context
        self.ops = ops
        self.reduce = reduce  # a row-parallel layer's: the shrink outputs summed over the ranks
        self.side = side if reduce is None else None  # (a reduce is a collective: kept on the main stream)
        # set by apply_lora where the op after this projection adds an overlapped delta itself
        self.deferred: DeferredDelta | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.deferred is not None:
            self.deferred.put(None)  # (until an overlapped step hands one over)
        batch = self.context.batch(x.shape[0])
        if not batch.active:
            return self.base_layer(x)
        lora = self.lora
        if self.side is not None and x.shape[0] <= self.ops.overlap_max_tokens:
            return self._overlapped(x, batch)
        y = self.base_layer(x)
        t = self.ops.shrink(x, lora.a, lora.scaling, batch)
        if self.reduce is not None:
            t = self.reduce(t)
        self.ops.expand(y, t, lora, batch)
        return y

    def _overlapped(self, x: torch.Tensor, batch) -> torch.Tensor:
        main, side, lora = torch.cuda.current_stream(x.device), self.side, self.lora
        side.wait_stream(main)  # x, and the step's slot map, are ready
        with torch.cuda.stream(side):
            t = self.ops.shrink(x, lora.a, lora.scaling, batch)
            delta = torch.zeros(x.shape[0], lora.b.shape[1], dtype=torch.float32, device=x.device)
            self.ops.expand(delta, t, lora, batch)
        y = self.base_layer(x)
        # (the buffers were made on `side`: each next use of that memory there comes after a
        # wait on the main stream, which orders it after the add below, or the op that adds it)
        if self.deferred is not None:  # the next op adds it as it reads y (lora/deferred.py)
            self.deferred.put(delta)
            return y
        main.wait_stream(side)
        return y.add_(delta)


@dataclass
class AppliedLoRA:
    """The handle of a model with LoRA layers: `remove()` puts the original layers back."""

    model: CausalLM
    store: LoRASlotStore
    context: LoRAContext

    def layers(self) -> list[LoRALinear]:
        return [m for m in self.model.modules() if isinstance(m, LoRALinear)]

    def remove(self) -> None:
        for layer in self.model.decoder_layers():
            for spec in self.store.weights.specs.values():
                parent = getattr(layer, spec.parent)
                wrapped = getattr(parent, spec.name)
                if isinstance(wrapped, LoRALinear):
                    setattr(parent, spec.name, wrapped.base_layer)
        for _, owner, name in self.model.lora_consumers():  # the ops that took deferred deltas, as they were
            consumer = getattr(owner, name)
            if isinstance(consumer, NormAddingDelta):
                setattr(owner, name, consumer.norm)
            elif isinstance(consumer, ActAddingDelta):
                setattr(owner, name, consumer.act)


def apply_lora(model: CausalLM, store: LoRASlotStore, context: LoRAContext,
               ops: LoRAOps = REFERENCE_LORA_OPS, side: torch.cuda.Stream | None = None) -> AppliedLoRA:  # fmt: skip
    """Wrap every adaptable projection of `model` (loaded) in a LoRALinear over `store`'s slots,
    reading the step's token slots from `context`. `side`: the second stream of overlapped steps
    (default: a new one, on CUDA when `ops` overlap)."""
    refused = family_of(model.arch).refuse("lora")
    if refused:
        raise ValueError(refused)
    if store.weights.arch != model.shard:
        raise ValueError("the LoRA slot store was made for another model architecture (or another rank's share)")
    dtype = model.embedding_dtype()  # the activations' (FP8 layers keep theirs)
    if store.weights.dtype != dtype:
        raise ValueError(f"the LoRA slots hold {store.weights.dtype}, the model computes in {dtype}")
    if context.num_slots != store.num_slots:
        raise ValueError(f"the LoRA context has {context.num_slots} slots, the store {store.num_slots}")
    device = store.weights.scaling.device
    if side is None and ops.overlap_max_tokens > 0 and device.type == "cuda":
        side = torch.cuda.Stream(device)  # one for every layer
    row = row_parallel(model.arch)
    for i, layer in enumerate(model.decoder_layers()):
        for spec in store.weights.specs.values():
            parent = getattr(layer, spec.parent)
            base = getattr(parent, spec.name)
            if isinstance(base, LoRALinear):
                raise ValueError(f"layer {i} {spec.name} already has LoRA applied")
            reduce = model.tp.all_reduce if model.tp.world_size > 1 and spec.name in row else None
            setattr(parent, spec.name, LoRALinear(base, store.projection(spec.name, i), context, ops, reduce, side))
    if side is not None:
        _defer_adds(model, side)
    return AppliedLoRA(model, store, context)


def _defer_adds(model: CausalLM, side: torch.cuda.Stream) -> None:
    """Let the op after each projection the model names (`lora_consumers`) add its overlapped delta
    (lora/deferred.py)."""
    for projection, owner, name in model.lora_consumers():
        if not isinstance(projection, LoRALinear) or projection.side is None:  # (row-parallel: no side stream)
            continue
        projection.deferred = DeferredDelta(side)
        wrap = ActAddingDelta if name == "act" else NormAddingDelta
        setattr(owner, name, wrap(getattr(owner, name), projection.deferred))
