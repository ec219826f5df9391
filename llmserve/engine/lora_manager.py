"""The engine core's LoRA adapters: read once into a host cache, placed in the runner's
device slots before each step that uses them.

An adapter is known by its `LoRARequest.key` (name and id): it is read from its path
(`llmserve.lora.read_peft_adapter`, checked against the base model) the first time a
request or a load names it, kept in a least-recently-used host cache of `max_cpu_loras`,
and written into a device slot when a step schedules a request that uses it. The scheduler
never runs more distinct adapters than there are slots, so a step's adapters always fit.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Collection

from llmserve.config import LoRAConfig
from llmserve.engine.lora_runner import RunnerLoRA
from llmserve.lora import LoRAAdapter, read_peft_adapter
from llmserve.lora.adapter import LoRAModuleWeights
from llmserve.lora_request import LoRARequest
from llmserve.model.interface import ModelArch


class LoRAManager:
    def __init__(self, config: LoRAConfig, arch: ModelArch, runner: RunnerLoRA) -> None:
        self.config = config
        self.arch = arch
        self.runner = runner
        self.cache: OrderedDict[str, LoRAAdapter] = OrderedDict()  # key -> adapter, least recently used first
        self.names: dict[str, str] = {}  # key -> adapter name, for the adapters held (host cache or slot)

    def adapter(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter `lora` names, read and checked on first use (LoRAAdapterError)."""
        adapter = self.cache.get(lora.key)
        if adapter is None:
            # in the slots' dtype (the copy into a slot would round to it the same way): half the
            # host memory and bytes moved of float32 for a bf16 model; pinned for a GPU, so a
            # slot write is an asynchronous copy
            weights = self.runner.store.weights
            adapter = read_peft_adapter(lora.lora_path, lora.key, self.arch, self.config.max_lora_rank, weights.dtype,
                                        lora.lora_roots)  # fmt: skip
            if weights.scaling.is_cuda:
                adapter = pinned(adapter)
            self.cache[lora.key] = adapter
            self.names[lora.key] = lora.lora_name
            while len(self.cache) > self.config.max_cpu_loras:
                self.cache.popitem(last=False)
            # only names of adapters still held somewhere (host cache or a slot): bounded
            held = set(self.cache) | set(self.runner.store.loaded())
            self.names = {key: name for key, name in self.names.items() if key in held}
        self.cache.move_to_end(lora.key)
        return adapter

    def prepare_step(self, loras: list[LoRARequest | None], counts: list[int]) -> None:
        """Put the step's adapters in slots (protecting each other) and map its tokens to them."""
        step = {lora.key: lora for lora in loras if lora is not None}
        for lora in step.values():
            self.runner.load(self.adapter(lora), protected=step.keys())
        self.runner.set_step([lora.key if lora is not None else None for lora in loras], counts)

    def remove(self, name: str, keep: Collection[str] = ()) -> list[str]:
        """Forget every adapter called `name` (any id) from the host cache and the slots, but
        those in `keep` (requests still use them); the keys removed."""
        keys = [k for k, n in self.names.items() if n == name and k not in keep]
        for key in keys:
            self.cache.pop(key, None)
            del self.names[key]
            self.runner.unload(key)
        return keys


def pinned(adapter: LoRAAdapter) -> LoRAAdapter:
    """The adapter with its tensors in page-locked host memory."""
    modules = {key: LoRAModuleWeights(w.a.pin_memory(), w.b.pin_memory()) for key, w in adapter.modules.items()}
    return dataclasses.replace(adapter, modules=modules)
