"""The model runner's LoRA part: the adapters' device slots, and each step's token -> slot map.

Built once the weights are loaded: every adaptable projection of the model is wrapped
(`llmserve.lora.apply_lora`) over a `LoRASlotStore` of `max_loras` slots and a
`LoRAContext` sized for the largest step (`always_apply` under CUDA graphs: the graphs are
captured with the LoRA ops in them, and replay for any mix of adapters). Adapters are placed in slots by the engine
core's `LoRAManager` before the step that uses them; `set_step` writes which slot each of
the step's tokens uses (the base model's tokens: none).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from llmserve.config import LoRAConfig
from llmserve.lora import LoRAAdapter, LoRAContext, LoRASlotStore, apply_lora
from llmserve.lora.ops import REFERENCE_LORA_OPS, triton_lora_ops
from llmserve.lora_batch import NO_ADAPTER


class RunnerLoRA:
    def __init__(self, config: LoRAConfig, model, max_num_tokens: int, dtype: torch.dtype, device: torch.device,
                 use_kernels: bool, always_apply: bool = False) -> None:  # fmt: skip
        self.store = LoRASlotStore(model.arch, config.max_loras, config.max_lora_rank, dtype, device)
        self.context = LoRAContext(max_num_tokens, config.max_loras, device, always_apply=always_apply)
        self.applied = apply_lora(model, self.store, self.context, triton_lora_ops() if use_kernels else REFERENCE_LORA_OPS)

    def load(self, adapter: LoRAAdapter, protected: Collection[str]) -> None:
        """Place `adapter` in a slot unless it holds one already (LoRAAdapterError NO_FREE_SLOT
        when every slot holds an adapter in `protected`)."""
        if adapter.name not in self.store.loaded():
            self.store.load(adapter, protected)

    def unload(self, name: str) -> None:
        if name in self.store.loaded():
            self.store.unload(name)

    def set_step(self, adapters: Sequence[str | None], counts: Sequence[int]) -> None:
        """The step's requests' adapter names (None: the base model) and token counts, in batch order."""
        slots: list[int] = []
        for name, count in zip(adapters, counts):
            slots.extend([self.store.slot_of(name) if name is not None else NO_ADAPTER] * count)
        self.context.set_token_slots(slots)
