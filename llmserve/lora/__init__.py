"""Multi-LoRA serving at the model level: PEFT adapters read and checked (`reader`), placed in a
fixed number of slots with LRU eviction (`store`), and applied per token in one batch
(`apply`, over the batched shrink/expand ops of `reference` or `llmserve.kernels.lora`).

| module | job |
| --- | --- |
| `errors` | LoRAAdapterError (a ValueError: HTTP 400; `status` per kind) |
| `peft_config` | adapter_config.json checked; unsupported PEFT features refused |
| `reader` | read_peft_adapter: the folder -> LoRAAdapter, shapes checked against the base model |
| `folder` | AdapterFolder: the folder opened once, its files through it, the allowed roots checked on what was opened |
| `adapter` | LoRAAdapter, LoRAModuleWeights |
| `projections` | PEFT module names -> llmserve's fused projections and their output slices |
| `slot_table` | name -> slot, least recently used eviction (bookkeeping only) |
| `slot_weights` | the stacked, zero-padded A/B tensors of every slot |
| `store` | LoRASlotStore: load / unload / slot_of by name |
| `context` | LoRAContext: the step's token -> slot mapping in fixed buffers |
| `reference`, `ops` | the PyTorch shrink/expand, and which implementation the layers call |
| `apply` | LoRALinear around the model's projections; apply_lora / AppliedLoRA.remove |
| `deferred` | an overlapped delta handed to the op after the projection (norm, activation), which adds it |

The engine, the scheduler, the servers and the gateway do not use it yet (docs/lora.md).
"""

from llmserve.lora.adapter import LoRAAdapter, LoRAModuleWeights
from llmserve.lora.apply import AppliedLoRA, LoRALinear, apply_lora
from llmserve.lora.context import LoRAContext
from llmserve.lora.errors import LoRAAdapterError, LoRAErrorKind
from llmserve.lora.ops import REFERENCE_LORA_OPS, LoRAOps, triton_lora_ops
from llmserve.lora.reader import read_peft_adapter
from llmserve.lora.store import LoRASlotStore

__all__ = [
    "REFERENCE_LORA_OPS",
    "AppliedLoRA",
    "LoRAAdapter",
    "LoRAAdapterError",
    "LoRAContext",
    "LoRAErrorKind",
    "LoRALinear",
    "LoRAModuleWeights",
    "LoRAOps",
    "LoRASlotStore",
    "apply_lora",
    "read_peft_adapter",
    "triton_lora_ops",
]
