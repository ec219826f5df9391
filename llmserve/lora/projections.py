"""Where LoRA targets sit in a model: its family's linear layers (model/interface.py `LinearSpec`)
that take adapters, PEFT's module names being each layer's parts.

A fused layer's parts are its output slices: Llama's qkv_proj is q_proj, k_proj and v_proj
concatenated on the output dimension, so an adapter's B for q_proj fills the first slice of
qkv_proj's output, k_proj's the second.
"""

from __future__ import annotations

from llmserve.model.interface import LinearSpec, ModelArch
from llmserve.model.registry import family_of

ProjectionSpec = LinearSpec


def projection_specs(arch: ModelArch) -> tuple[LinearSpec, ...]:
    """The linear layers of every decoder layer of `arch` that take adapters (the whole model: one rank)."""
    return tuple(spec for spec in family_of(arch).linears(arch) if spec.lora)


def supported_modules(arch: ModelArch) -> tuple[str, ...]:
    """PEFT module names an adapter of this model may target."""
    return tuple(part for spec in projection_specs(arch) for part in spec.parts)


def row_parallel(arch: ModelArch) -> frozenset[str]:
    """The layers (by attribute name) whose input is split over tensor-parallel ranks, and their parts."""
    return frozenset(
        name for spec in projection_specs(arch) if spec.parallel == "row" for name in (spec.name, *spec.parts)
    )


def module_parent(arch: ModelArch, module: str) -> str:
    """Where PEFT finds `module` in a Hugging Face decoder layer (self_attn, mlp)."""
    return next(spec.parent for spec in projection_specs(arch) if module in spec.parts)


def module_shapes(arch: ModelArch) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in_features, out_features) of the base layer it adapts."""
    return {m: (spec.in_features, w) for spec in projection_specs(arch) for m, w in zip(spec.parts, spec.widths)}


def module_place(arch: ModelArch) -> dict[str, tuple[str, int]]:
    """PEFT module name -> (fused layer's attribute name, slice index)."""
    return {m: (spec.name, j) for spec in projection_specs(arch) for j, m in enumerate(spec.parts)}
