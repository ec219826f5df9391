"""The adapters' A and B of every slot, stacked per fused projection and zero-padded to the
maximum rank, where the batched LoRA ops read them.

Per projection (qkv_proj, o_proj, gate_up_proj, down_proj):
  a: [layers, slots, slices, max_rank, in_features]  (slice j: the A of q_proj, k_proj ... in output order)
  b: [layers, slots, out_features, max_rank]         (the slices' B concatenated as the fused output is)
and one scaling per slot. With `output_major_b` (the GEMM form of the expand is on) B is stored
[layers, out_features, slots, max_rank] and `b` is a view of it in slot order, so one layer's B
of every slot is also one plain matrix [out_features, slots * max_rank] (`ProjectionLoRA.b_all`)
that llmserve/lora/expand_gemm.py multiplies in one call. Otherwise each slot's B is contiguous,
as the Triton expand was measured with (its B tiles read whole rows of one slot). A rank below
the maximum leaves zero rows of A and zero columns of B; a module or layer an adapter lacks
stays all zero: both add nothing. Writing a slot copies in place, so the views handed to the
model's layers (and CUDA graphs) keep their addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.lora.adapter import LoRAAdapter
from llmserve.lora.errors import LoRAAdapterError, LoRAErrorKind
from llmserve.lora.projections import ProjectionSpec, module_place, projection_specs
from llmserve.model.interface import ModelArch


@dataclass(frozen=True, slots=True)
class ProjectionLoRA:
    """What one LoRA layer reads: views of the stacked weights of one projection in one layer."""

    a: torch.Tensor  # [slots, slices, max_rank, in_features]
    b: torch.Tensor  # [slots, out_features, max_rank] (a strided view: see `b_all`)
    scaling: torch.Tensor  # [slots] float32
    slice_offsets: torch.Tensor  # [slices + 1] int32 on the weights' device
    max_slice_width: int
    slice_bounds: tuple[int, ...] = ()  # the same offsets on the host

    @property
    def b_all(self) -> torch.Tensor:
        """[out_features, slots * max_rank]: column s * max_rank + r is B[s][:, r] (a view when the
        store keeps B output-major; a copy otherwise)."""
        return self.b.permute(1, 0, 2).reshape(self.b.shape[1], -1)


class SlotWeights:
    def __init__(self, arch: ModelArch, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str, output_major_b: bool = False) -> None:  # fmt: skip
        self.arch = arch
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.dtype = dtype
        self.specs = {spec.name: spec for spec in projection_specs(arch)}
        self._place = module_place(arch)
        layers = arch.num_layers
        self.a = {s.name: torch.zeros(layers, num_slots, len(s.widths), max_rank, s.in_features, dtype=dtype,
                                      device=device) for s in self.specs.values()}  # fmt: skip
        if output_major_b:
            self.b = {s.name: torch.zeros(layers, s.out_features, num_slots, max_rank, dtype=dtype, device=device)
                      .permute(0, 2, 1, 3) for s in self.specs.values()}  # fmt: skip
        else:
            self.b = {s.name: torch.zeros(layers, num_slots, s.out_features, max_rank, dtype=dtype, device=device)
                      for s in self.specs.values()}  # fmt: skip
        self.scaling = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self._offsets = {s.name: torch.tensor(s.offsets, dtype=torch.int32, device=device) for s in self.specs.values()}

    def check(self, adapter: LoRAAdapter) -> None:
        """Raise LoRAAdapterError unless `adapter` fits these slots (rank, modules, shapes)."""
        if adapter.rank > self.max_rank:
            raise LoRAAdapterError(LoRAErrorKind.RANK_TOO_LARGE,
                                   f"rank {adapter.rank} is above the maximum LoRA rank {self.max_rank}")  # fmt: skip
        for (layer, module), w in adapter.modules.items():
            self._check(layer, module, w.a.shape, w.b.shape, adapter.rank)

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` (checked) in `slot`; whatever was there is cleared."""
        self.check(adapter)
        self.clear(slot)
        for (layer, module), w in adapter.modules.items():
            name, j = self._place[module]
            lo, hi = self.specs[name].offsets[j], self.specs[name].offsets[j + 1]
            self.a[name][layer, slot, j, : adapter.rank].copy_(w.a, non_blocking=True)  # from pinned memory: async
            self.b[name][layer, slot, lo:hi, : adapter.rank].copy_(w.b, non_blocking=True)
        self.scaling[slot] = adapter.scaling

    def clear(self, slot: int) -> None:
        for name in self.specs:
            self.a[name][:, slot].zero_()
            self.b[name][:, slot].zero_()
        self.scaling[slot] = 0.0

    def projection(self, name: str, layer: int) -> ProjectionLoRA:
        spec = self.specs[name]
        return ProjectionLoRA(self.a[name][layer], self.b[name][layer], self.scaling, self._offsets[name],
                              max(spec.widths), tuple(spec.offsets))  # fmt: skip

    def _check(self, layer: int, module: str, a_shape: torch.Size, b_shape: torch.Size, rank: int) -> None:
        if module not in self._place:
            raise LoRAAdapterError(LoRAErrorKind.UNSUPPORTED_MODULE, f"module {module!r} is not supported")
        spec: ProjectionSpec = self.specs[self._place[module][0]]
        width = spec.widths[self._place[module][1]]
        if (
            layer >= self.arch.num_layers
            or tuple(a_shape) != (rank, spec.in_features)
            or tuple(b_shape) != (width, rank)
        ):
            raise LoRAAdapterError(LoRAErrorKind.SHAPE_MISMATCH,
                                   f"layer {layer} {module}: A {list(a_shape)} / B {list(b_shape)} do not fit the "
                                   f"base model ([{rank}, {spec.in_features}] / [{width}, {rank}])")  # fmt: skip
