"""Where LoRA targets sit in llmserve's Llama: PEFT's module names (q_proj ... down_proj) mapped
onto the model's fused projections, with each one's input size and output slices.

qkv_proj is q, k and v concatenated on the output dimension, gate_up_proj is gate and up: an
adapter's B for q_proj fills the first slice of qkv_proj's output, k_proj's the second.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmserve.model.arch import ModelArch

SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the projections whose input is split over tensor-parallel ranks (row-parallel); their names
# are both the fused projection's and the PEFT module's
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class ProjectionSpec:
    """One fused projection of a decoder layer and the PEFT modules that are its slices."""

    name: str  # the layer's attribute: qkv_proj, o_proj, gate_up_proj, down_proj
    parent: str  # self_attn or mlp
    in_features: int
    modules: tuple[str, ...]  # PEFT module names of its output slices, in output order
    widths: tuple[int, ...]  # output features of each slice

    @property
    def out_features(self) -> int:
        return sum(self.widths)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Slice boundaries on the output dimension: slice j is [offsets[j], offsets[j + 1])."""
        out = [0]
        for w in self.widths:
            out.append(out[-1] + w)
        return tuple(out)


def projection_specs(arch: ModelArch) -> tuple[ProjectionSpec, ...]:
    """The four projections of every decoder layer of `arch` (the whole model: one rank)."""
    h, q, kv, inter = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    return (
        ProjectionSpec("qkv_proj", "self_attn", h, ("q_proj", "k_proj", "v_proj"), (q, kv, kv)),
        ProjectionSpec("o_proj", "self_attn", q, ("o_proj",), (h,)),
        ProjectionSpec("gate_up_proj", "mlp", h, ("gate_proj", "up_proj"), (inter, inter)),
        ProjectionSpec("down_proj", "mlp", inter, ("down_proj",), (h,)),
    )


def module_parent(module: str) -> str:
    """self_attn or mlp: where PEFT finds `module` in a Hugging Face decoder layer."""
    return _PARENT[module]


def module_shapes(arch: ModelArch) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in_features, out_features) of the base layer it adapts."""
    return {m: (spec.in_features, w) for spec in projection_specs(arch) for m, w in zip(spec.modules, spec.widths)}


def module_place(arch: ModelArch) -> dict[str, tuple[str, int]]:
    """PEFT module name -> (fused projection, slice index)."""
    return {m: (spec.name, j) for spec in projection_specs(arch) for j, m in enumerate(spec.modules)}
