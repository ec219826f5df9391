"""An adapter's part for one tensor-parallel rank, split as the base model's weights are.

Column-parallel projections (q, k, v, gate, up: each rank computes a slice of the outputs)
keep A whole and take their rows of B. Row-parallel ones (o, down: each rank holds a slice of
the inputs) take their columns of A and keep B whole; their shrink outputs are summed over
the ranks (an all-reduce of a few numbers a token) before the expand, so every rank adds the
same delta after the base layer's own all-reduce. Slices are contiguous, rank r's the r-th,
as the checkpoint loader cuts the base weights (model/llama.py).
"""

from __future__ import annotations

import dataclasses

from llmserve.lora.adapter import LoRAAdapter, LoRAModuleWeights
from llmserve.lora.projections import module_shapes, row_parallel
from llmserve.model.interface import ModelArch, local_arch


def shard_adapter(adapter: LoRAAdapter, arch: ModelArch, world_size: int, rank: int) -> LoRAAdapter:
    """`adapter` (read for the whole model `arch`) as rank `rank` of `world_size` holds it."""
    if world_size == 1:
        return adapter
    local = module_shapes(local_arch(arch, world_size))
    modules = {}
    row = row_parallel(arch)
    for (layer, module), w in adapter.modules.items():
        in_local, out_local = local[module]
        if module in row:
            a, b = w.a.narrow(1, rank * in_local, in_local), w.b
        else:
            a, b = w.a, w.b.narrow(0, rank * out_local, out_local)
        modules[(layer, module)] = LoRAModuleWeights(a.contiguous(), b.contiguous())
    return dataclasses.replace(adapter, modules=modules)
