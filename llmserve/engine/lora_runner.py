"""The model runner's LoRA part: the adapters' device slots, and each step's token -> slot map.

Built once the weights are loaded: every adaptable projection of the model is wrapped
(`llmserve.lora.apply_lora`) over a `LoRASlotStore` of `max_loras` slots and a
`LoRAContext` sized for the largest step (`always_apply` under CUDA graphs: the graphs are
captured with the LoRA ops in them, and replay for any mix of adapters).

The driver decides: which slot an adapter goes to (the store's table, least recently used
first), and each step's token -> slot map. Every tensor-parallel rank then does the same
with its own share: `write_shard` puts its part of an adapter (lora/shard.py) in the slot the
driver chose (through the runner's `write_lora_slot`, run on every rank), and the step's
map travels with the step's inputs. So the ranks' slots never disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from llmserve.config import LoRAConfig
from llmserve.lora import LoRAAdapter, LoRAContext, LoRASlotStore, apply_lora
from llmserve.lora.ops import GEMM_EXPAND_MIN_WIDTH, REFERENCE_LORA_OPS, triton_lora_ops
from llmserve.lora.projections import projection_specs
from llmserve.lora.shard import shard_adapter
from llmserve.lora_batch import NO_ADAPTER


class RunnerLoRA:
    def __init__(self, config: LoRAConfig, model, max_num_tokens: int, dtype: torch.dtype, device: torch.device,
                 use_kernels: bool, always_apply: bool = False,
                 write_slot: Callable[[int, LoRAAdapter | None], None] | None = None) -> None:  # fmt: skip
        """`write_slot(slot, adapter or None)`: writes (or clears) a slot on every rank (the
        runner's mirrored call); by default this rank's `write_shard`."""
        self.model = model
        # B is stored output-major (one matrix over every slot) only where some projection of this
        # rank expands through the GEMM; elsewhere the slot-major layout the Triton expand was tuned on
        gemm_expand = (
            use_kernels
            and config.expand_gemm_tokens > 0
            and any(spec.out_features >= GEMM_EXPAND_MIN_WIDTH for spec in projection_specs(model.shard))
        )
        self.store = LoRASlotStore(model.shard, config.max_loras, config.max_lora_rank, dtype, device,
                                   output_major_b=gemm_expand)  # fmt: skip
        self.context = LoRAContext(max_num_tokens, config.max_loras, device, always_apply=always_apply)
        ops = triton_lora_ops(config.expand_gemm_tokens if gemm_expand else 0,
                              overlap_max_tokens=config.overlap_tokens) if use_kernels else REFERENCE_LORA_OPS  # fmt: skip
        self.applied = apply_lora(model, self.store, self.context, ops)
        self.write_slot = write_slot or self.write_shard
        self.pending_slots: list[int] | None = None  # the next step's token -> slot map (driver)
        self.slot_loads = 0  # adapters written into a slot so far (with fewer slots than adapters: the swaps)

    def shard(self, adapter: LoRAAdapter) -> LoRAAdapter:
        tp = self.model.tp
        return shard_adapter(adapter, self.model.arch, tp.world_size, tp.rank)

    def load(self, adapter: LoRAAdapter, protected: Collection[str]) -> None:
        """Place `adapter` in a slot unless it holds one already (LoRAAdapterError NO_FREE_SLOT
        when every slot holds an adapter in `protected`, or the adapter does not fit)."""
        if adapter.name in self.store.loaded():
            return
        self.write_slot(self.store.place(self.shard(adapter), protected).slot, adapter)
        self.slot_loads += 1

    def unload(self, name: str) -> None:
        if name in self.store.loaded():
            self.write_slot(self.store.table.release(name), None)

    def write_shard(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """This rank's part of `adapter` into `slot` (None: clear it)."""
        if adapter is None:
            self.store.weights.clear(slot)
        else:
            self.store.weights.write(slot, self.shard(adapter))

    def set_step(self, adapters: Sequence[str | None], counts: Sequence[int]) -> None:
        """The step's requests' adapter names (None: the base model) and token counts, in batch
        order: the token -> slot map goes out with the step's inputs (`take_step_slots`)."""
        slots: list[int] = []
        for name, count in zip(adapters, counts):
            slots.extend([self.store.slot_of(name) if name is not None else NO_ADAPTER] * count)
        self.pending_slots = slots

    def take_step_slots(self) -> list[int] | None:
        slots, self.pending_slots = self.pending_slots, None
        return slots
