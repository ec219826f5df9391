"""The one model interface: what a model family declares and what its causal LM offers.

Everything outside `llmserve/model/` (the engine, the runner, LoRA, tensor parallelism, FP8,
CUDA graphs, the KV cache) knows a model only through these: a `ModelFamily` (registered in
`model/registry.py`) declares the shapes (`LinearSpec` per linear layer, `AttentionSpec` per
layer), the checkpoint names and the features it refuses; the model it builds is a `CausalLM`.
Adding a family is one file that defines its `FAMILY` and its model, plus a registry line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from llmserve.model.arch import ModelArch  # the engine's view of a model's shape, part of this interface

if TYPE_CHECKING:
    import torch
    from torch import nn

    from llmserve.attention_metadata import AttentionMetadata, SampledRows
    from llmserve.model.gguf.checkpoint import GGUFCheckpoint

__all__ = [
    "AttentionSpec",
    "CausalLM",
    "ExpertSpec",
    "Feature",
    "HiddenCapture",
    "count_expert_tokens",
    "expert_token_counts",
    "LinearSpec",
    "ModelArch",
    "ModelFamily",
    "layer_module_name",
    "local_arch",
]

# the features a family may refuse (`ModelFamily.unsupported`'s keys), by the name config.py asks
# with and the error message uses: LoRA adapters, `--quantization` (fp8), tensor parallelism, an
# FP8 KV cache, FP8 weights on the Triton backend, an FP8 checkpoint
Feature = Literal["lora", "quantization", "tensor_parallel", "fp8_kv_cache", "fp8_triton", "fp8_checkpoint"]


@dataclass(frozen=True, slots=True)
class LinearSpec:
    """One linear layer of every decoder layer, as the whole model (one rank) holds it."""

    path: str  # its module path inside a decoder layer: "self_attn.qkv_proj"
    in_features: int
    parts: tuple[str, ...]  # the checkpoint's module names of its output slices, in output order
    widths: tuple[int, ...]  # output features of each part
    parallel: Literal["column", "row"]  # tensor parallelism: outputs split, or inputs split and summed
    lora: bool = True  # an adapter may target its parts
    fp8: bool = True  # `--quantization fp8` quantizes it
    layers: tuple[int, ...] | None = None  # the decoder layers that hold it (None: every one)

    def in_layer(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    @property
    def name(self) -> str:
        """The attribute that holds it: qkv_proj."""
        return self.path.rpartition(".")[2]

    @property
    def parent(self) -> str:
        """The submodule of the decoder layer that holds it: self_attn."""
        return self.path.rpartition(".")[0]

    @property
    def out_features(self) -> int:
        return sum(self.widths)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Slice boundaries on the output dimension: part j is [offsets[j], offsets[j + 1])."""
        out = [0]
        for w in self.widths:
            out.append(out[-1] + w)
        return tuple(out)


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """One decoder layer's attention, as its KV cache and kernels see it."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None = None  # sliding window: a query at p sees keys in (p - window, p]; None: all

    @property
    def kv_width(self) -> int:
        """Key (or value) elements one token stores in this layer."""
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True, slots=True)
class ExpertSpec:
    """One decoder layer's mixture of experts (its MLP's place): a router over `num_experts` gated
    MLPs (down(silu(gate(x)) * up(x)), `intermediate` wide each), `top_k` of them a token, plus
    optionally a shared expert every token passes (`shared_intermediate` wide, sigmoid-gated).
    Sizes are the whole model's (one rank's share: `ModelArch.local`)."""

    num_experts: int
    top_k: int
    hidden: int
    intermediate: int  # each expert's MLP width
    shared_intermediate: int = 0  # the shared expert's width (0: none)
    path: str = "mlp"  # the block's module path inside a decoder layer
    fp8: bool = True  # `--quantization fp8` quantizes the experts

    @property
    def expert_weights(self) -> int:
        """Weights of one expert (gate, up and down)."""
        return 3 * self.hidden * self.intermediate

    @property
    def shared_weights(self) -> int:
        """Weights every token reads besides its experts: the router, the shared expert and its gate."""
        shared = 3 * self.hidden * self.shared_intermediate + (self.hidden if self.shared_intermediate else 0)
        return self.num_experts * self.hidden + shared

    def experts_read(self, tokens: int) -> float:
        """Experts a step of `tokens` tokens reads, expected under uniform routing (each token picks
        `top_k` distinct experts): `top_k` for one token, every expert for a large batch."""
        if tokens <= 0:
            return 0.0
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** tokens)


@dataclass(slots=True)
class HiddenCapture:
    """Hidden states a forward keeps for an EAGLE head (model/eagle.py), set on the model with
    `CausalLM.set_hidden_capture` only when a head is configured: the residual stream entering
    each of `layers` (in that order), then with `final` the final hidden states after the final
    norm, every row of the step's tokens each. The forward replaces `states`."""

    layers: tuple[int, ...] = ()
    final: bool = False
    states: list[Any] = field(default_factory=list)  # [T, hidden] tensors of the latest forward


class CausalLM(Protocol):
    """What the runner, CUDA graphs, LoRA and the loaders call on a built model."""

    arch: ModelArch
    shard: ModelArch  # this rank's share of `arch` under tensor parallelism
    tp: Any  # its tensor-parallel group (model/tensor_parallel.py TPGroup)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                sampled: SampledRows | None = None) -> torch.Tensor: ...  # fmt: skip

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    # Pipeline parallelism (model/pipeline.py): a stage keeps its own layers (set on the meta device,
    # before allocation) and runs them from the embedding or from the previous stage's carried
    # (hidden states, residual); the last stage returns what `forward` returns.
    def set_pipeline_stage(self, stage: Any) -> None: ...

    def forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      carried: tuple[torch.Tensor, torch.Tensor] | None,
                      sampled: SampledRows | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip

    def attention_layers(self) -> list[nn.Module]:
        """Each layer's attention module: `.kv_cache` and `.kv_group` (bound by the runner; a
        layer of group g > 0 attends with `meta.groups[g - 1]`), `.kv_scales`,
        `.attend(q, k, v, meta, out=)`."""
        ...

    def decoder_layers(self) -> Sequence[nn.Module]:
        """The decoder layers, in order: each holds its `LinearSpec.path` submodules."""
        ...

    def embedding_dtype(self) -> torch.dtype:
        """The activations' dtype."""
        ...

    def token_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding table's rows of `input_ids` (unscaled: what an EAGLE head takes)."""
        ...

    def set_hidden_capture(self, capture: HiddenCapture | None) -> None:
        """Keep these hidden states from every eager forward (None: none, the default)."""
        ...

    # The forward cut at its attention calls (piecewise CUDA graphs run attention between pieces):
    # piece 0 = the embedding and layer 0 up to attention; piece i = layer i-1 after its attention
    # and layer i up to its attention; the last = the last layer after attention and the final norm.
    def first_piece(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]: ...

    def middle_piece(self, i: int, attn_out: torch.Tensor, residual: torch.Tensor,
                     positions: torch.Tensor) -> tuple[torch.Tensor, ...]: ...  # fmt: skip

    def last_piece(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...

    def lora_consumers(self) -> list[tuple[nn.Module, nn.Module, str]]:
        """(projection, owner, attribute) of the op right after each projection whose LoRA delta
        that op adds in overlapped steps (lora/deferred.py); a family that refuses LoRA raises."""
        ...

    def expected_weight_keys(self) -> set[str]: ...


@dataclass(frozen=True)
class ModelFamily:
    """One family's declarations: which checkpoints it serves and the shapes it has."""

    name: str
    architectures: tuple[str, ...]  # Hugging Face `architectures` entries it serves
    model_types: tuple[str, ...]  # Hugging Face `model_type`s (a config that names no architecture)
    gguf_architectures: tuple[str, ...]  # GGUF `general.architecture` values
    parse_config: Callable[[dict], ModelArch]  # config.json -> the engine's view
    build: Callable[..., CausalLM]  # (arch, backend, max_positions, ops, tp, quantization, quantization_ignore)
    linears: Callable[[ModelArch], tuple[LinearSpec, ...]]  # the decoder layers' linear layers
    attention: Callable[[ModelArch], tuple[AttentionSpec, ...]]  # one per decoder layer
    # one per decoder layer: its mixture of experts, or None (a dense layer); () for a dense family
    experts: Callable[[ModelArch], tuple[ExpertSpec | None, ...]] = lambda arch: ()
    # GGUF: the metadata's extra config.json keys (given the common ones), a tensor's Hugging Face
    # name (None: not a weight), and a tensor's values as the Hugging Face model holds them
    gguf_config: Callable[[GGUFCheckpoint, dict], dict] = lambda ckpt, config: config
    gguf_tensor_name: Callable[[str], str | None] = lambda name: None
    gguf_tensor_values: Callable[[str, Any, ModelArch, str], Any] = lambda hf_name, tensor, arch, gguf_arch: tensor
    # a feature this family refuses -> why (said at start, in the error)
    unsupported: Mapping[str, str] = field(default_factory=dict)

    def refuse(self, feature: str) -> str | None:
        """Why this family cannot run with `feature`, or None."""
        reason = self.unsupported.get(feature)
        return None if reason is None else f"{self.name} models do not support {feature.replace('_', ' ')}: {reason}"


def layer_module_name(layer: int, path: str) -> str:
    """The full module name of a decoder layer's submodule: model.layers.3.mlp.down_proj."""
    return f"model.layers.{layer}.{path}"


def is_moe(arch: ModelArch) -> bool:
    """Whether some layer of `arch` is a mixture of experts (its family's `experts`)."""
    from llmserve.model.registry import family_of

    return any(spec is not None for spec in family_of(arch).experts(arch))


def count_expert_tokens(model: nn.Module, on: bool = True) -> bool:
    """Start (zeroed) or stop counting each MoE layer's tokens per expert (load balance; off by
    default, cheap: no host sync); False if the model has no experts."""
    from llmserve.model.moe_block import count_expert_tokens as count

    return count(model, on)


def expert_token_counts(model: nn.Module) -> dict[int, list[int]] | None:
    """Tokens each expert got since counting started, by sparse layer; None when not counting."""
    from llmserve.model.moe_block import expert_token_counts as counts

    return counts(model)


def local_arch(arch: ModelArch, world_size: int, expert_parallel: bool = False) -> ModelArch:
    """The shape one rank holds: its share of the heads and of the MLP (`ModelArch.local`; a MoE
    arch's experts too: their width split, or with `expert_parallel` whole experts)."""
    if world_size == 1:
        return arch
    return arch.local(world_size, expert_parallel)
