"""The sparse mixture-of-experts decoder block the MoE families share (qwen3_moe.py, qwen2_moe.py,
mixtral.py), built on the Llama family's attention, layer, model and causal LM.

A layer is Llama's with its MLP replaced by `SparseMoeBlock` (router, E experts, optionally
Qwen2-MoE's shared expert and its sigmoid gate) where the config makes it sparse, or Llama's dense
MLP where it does not (Qwen's `mlp_only_layers`, `decoder_sparse_step`). The experts are two
stacked parameters, `experts.gate_up_proj [E, 2 * I, H]` and `experts.down_proj [E, H, I]`, as
transformers holds them; `ops.fused_moe` runs them (the Triton kernels, kernels/fused_moe.py, or
the PyTorch reference, model/moe.py). Checkpoints give them per expert
(`experts.{e}.gate_proj.weight` ..., as published and as transformers' `save_pretrained`
writes) or stacked (transformers' in-memory names); both load, each tensor's shape checked
against the config. The families declare the experts to the rest of the engine as `ExpertSpec`s
(model/interface.py).

Tensor parallelism: every rank holds every expert's slice of the intermediate dimension (gate and
up rows, down columns) and the shared expert's; expert parallelism (`TPGroup.expert_parallel`):
each rank holds E / world whole experts, routes every token and adds only its experts' share. Either
way a block's output on a rank is a partial sum (routed plus gated shared expert), summed over the
ranks by one all-reduce, as the dense MLP's down projection is.

FP8 experts (E4M3 weights, float32 scales, tokens quantized per token; the fused kernels or the
reference run them): `--quantization fp8` on a 16-bit checkpoint quantizes each rank's slice per
output channel as it loads; an FP8 checkpoint's experts load as they are, with their scales per
tensor or per channel (`weight_scale`: compressed-tensors, `quant_method: fp8`) or per block
(`weight_scale_inv` with the config's `weight_block_size`, as Qwen3-30B-A3B-FP8 publishes),
each scale's shape checked against its weight; the block-scaled checkpoint's dense projections
(attention) are dequantized and quantized per channel as they load (model/fp8_blocks.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model import llama
from llmserve.model.arch import ModelArch, UnsupportedModelError, eos_token_ids, parse_rope
from llmserve.model.attention import AttentionBackend
from llmserve.model.fp8 import FP8, quantize_rows
from llmserve.model.fp8_blocks import (
    BLOCK_SCALE_SUFFIX,
    block_grid,
    check_block_scale,
    merge_block_scales,
    quantize_blocks,
)
from llmserve.model.interface import ExpertSpec, LinearSpec
from llmserve.model.layers import LayerOps, RMSNorm, RotaryEmbedding
from llmserve.model.llama import MLP, Attention, LlamaForCausalLM
from llmserve.model.tensor_parallel import SINGLE, TPGroup, VocabParallelEmbedding, local_arch, rank_slice


@dataclass(frozen=True, slots=True)
class MoeArch(ModelArch):
    """A mixture-of-experts model's shape: `ModelArch` (whose `intermediate_size` is the dense
    layers' MLP) and its experts'."""

    num_experts: int = 0
    top_k: int = 0  # experts per token
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = True  # the chosen experts' weights renormalised to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    sparse_layers: tuple[bool, ...] = ()  # per layer: its MLP is the experts (else dense)
    local_experts: int = 0  # experts one rank holds under expert parallelism (0: every one)
    # an FP8 checkpoint's weight scale blocks (bn, bk) (`weight_block_size`); None: per channel
    expert_block_shape: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        block = self.expert_block_shape
        if block and (self.moe_intermediate_size % block[0] or self.moe_intermediate_size % block[1]):
            raise UnsupportedModelError(
                f"the experts' width {self.moe_intermediate_size} (moe_intermediate_size, a rank's share under tensor "
                f"parallelism) is not a multiple of the FP8 scale blocks {list(block)}: an expert's gate and up "
                "rows, and a rank's columns, must not share a block"
            )

    def local(self, world_size: int, expert_parallel: bool = False) -> MoeArch:
        """A rank's share: heads, the dense MLP and the shared expert split; the experts' width split,
        or with `expert_parallel` E / world_size whole experts."""
        base = ModelArch.local(self, world_size)
        return dataclasses.replace(
            base,
            moe_intermediate_size=self.moe_intermediate_size // (1 if expert_parallel else world_size),
            shared_expert_intermediate_size=self.shared_expert_intermediate_size // world_size,
            local_experts=self.num_experts // world_size if expert_parallel else 0,
        )

    def tp_split_sizes(self, expert_parallel: bool = False) -> dict[str, int]:
        sizes = ModelArch.tp_split_sizes(self, expert_parallel)
        if all(self.sparse_layers):  # no dense MLP to split
            del sizes["intermediate_size"]
        if expert_parallel:
            sizes["num_experts"] = self.num_experts
        else:
            sizes["moe_intermediate_size"] = self.moe_intermediate_size
        if self.shared_expert_intermediate_size:
            sizes["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return sizes

    @property
    def held_experts(self) -> int:
        """The experts this (rank's) arch holds."""
        return self.local_experts or self.num_experts


# the features every MoE family refuses for now (FAMILY.unsupported), by config.py's names
UNSUPPORTED = {
    "lora": "the experts are not LoRA-capable linear layers and adapters on the attention projections "
    "alone are not wired for MoE models yet",
}


class Experts(nn.Module):
    """E gated MLPs' weights, stacked: gate and up rows `[E, 2 * I, H]` (gate first), down `[E, H, I]`;
    in FP8 with float32 scales (`gate_up_proj_scale`, `down_proj_scale`): one per output row
    (`[E, 2 * I, 1]`, `[E, H, 1]`), or one per `block_shape` (bn, bk) block (`[E, 2 * I / bn,
    ceil(H / bk)]`, `[E, ceil(H / bn), ceil(I / bk)]`: the gate's blocks, then the up's)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, fp8: bool = False,
                 block_shape: tuple[int, int] | None = None) -> None:  # fmt: skip
        super().__init__()
        dtype = {"dtype": FP8} if fp8 else {}
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden, **dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter, **dtype), requires_grad=False)
        self.gate_up_proj_scale = self.down_proj_scale = None
        self.block_shape = block_shape if fp8 else None
        if fp8:
            f32 = torch.float32
            grid13, grid2 = (2 * inter, 1), (hidden, 1)
            if block_shape is not None:
                grid13 = (2 * inter // block_shape[0], block_grid((hidden, hidden), block_shape)[1])
                grid2 = block_grid((hidden, inter), block_shape)
            self.gate_up_proj_scale = nn.Parameter(torch.empty(num_experts, *grid13, dtype=f32), False)
            self.down_proj_scale = nn.Parameter(torch.empty(num_experts, *grid2, dtype=f32), False)

    def scales(self) -> dict[str, torch.Tensor]:
        """The FP8 scales as `fused_moe` takes them (none for 16-bit experts)."""
        if self.gate_up_proj_scale is None:
            return {}
        blocks = {} if self.block_shape is None else {"block_shape": self.block_shape}
        return {"w13_scale": self.gate_up_proj_scale, "w2_scale": self.down_proj_scale, **blocks}

    def fp8_pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(FP8 weight, its scale) pairs (dummy weights are drawn and quantized through these)."""
        if self.gate_up_proj_scale is None:
            return []
        return [(self.gate_up_proj, self.gate_up_proj_scale), (self.down_proj, self.down_proj_scale)]


class SparseMoeBlock(nn.Module):
    """router -> top-k experts -> weighted sum (+ the shared expert, sigmoid-gated); under tensor or
    expert parallelism each rank's partial sum, all-reduced."""

    def __init__(self, arch: MoeArch, ops: LayerOps, tp: TPGroup, quantization: str | None = None) -> None:
        super().__init__()
        self.top_k = arch.top_k
        self.renormalize = arch.norm_topk_prob
        self.fused_moe = ops.fused_moe
        self.tp = tp
        self.first_expert = tp.rank * arch.held_experts if arch.local_experts else 0
        self.gate = nn.Linear(arch.hidden_size, arch.num_experts, bias=False)  # the router, over every expert
        self.experts = Experts(arch.held_experts, arch.hidden_size, arch.moe_intermediate_size, quantization == "fp8",
                               arch.expert_block_shape)  # fmt: skip
        self.shared_expert = self.shared_expert_gate = None
        self.expert_counts: torch.Tensor | None = None  # tokens routed to each expert, when counted
        if arch.shared_expert_intermediate_size:
            shared = dataclasses.replace(arch, intermediate_size=arch.shared_expert_intermediate_size)
            self.shared_expert = MLP(shared, ops, SINGLE, quantization)  # its partial sum joins the block's
            self.shared_expert_gate = nn.Linear(arch.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.gate.weight)
        if self.expert_counts is not None:
            self.count(logits)
        extra = {"first_expert": self.first_expert} if self.first_expert else {}
        out = self.fused_moe(x, logits, self.experts.gate_up_proj, self.experts.down_proj, self.top_k,
                             self.renormalize, **extra, **self.experts.scales())  # fmt: skip
        if self.shared_expert is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x)
        return self.tp.all_reduce(out)

    def count(self, logits: torch.Tensor) -> None:
        """Add each expert's tokens of this step to `expert_counts` (on the device, no host sync): the
        router's top k (its order is the softmax's)."""
        ids = torch.topk(logits, self.top_k, dim=-1).indices.reshape(-1)
        self.expert_counts.index_add_(0, ids, torch.ones_like(ids, dtype=self.expert_counts.dtype))


def count_expert_tokens(model: nn.Module, on: bool = True) -> bool:
    """Start (zeroed) or stop counting the tokens each MoE block routes to each expert (load
    balance): an `index_add_` on the device per block and step, no host sync. With CUDA graphs the
    count must be on when they are captured. False: the model has no experts."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    for block in blocks:
        experts = block.gate.weight.shape[0]
        block.expert_counts = torch.zeros(experts, dtype=torch.int64, device=block.gate.weight.device) if on else None
    return bool(blocks)


def expert_token_counts(model: nn.Module) -> dict[int, list[int]] | None:
    """Tokens routed to each expert since counting started, by layer index (sparse layers only; each
    token counts once per expert it picked); None if nothing is counted."""
    counts = {}
    for name, module in model.named_modules():
        if isinstance(module, SparseMoeBlock) and module.expert_counts is not None:
            counts[int(name.split(".")[2])] = module.expert_counts.tolist()  # model.layers.N.mlp
    return counts or None


class MoeDecoderLayer(llama.DecoderLayer):
    """Llama's layer (forward, sampled rows, the part before attention) with the MoE block as its MLP."""

    def __init__(self, arch: MoeArch, backend: AttentionBackend, rotary: RotaryEmbedding, ops: LayerOps,
                 tp: TPGroup, quantization: str | None, window: int | None, sparse: bool) -> None:  # fmt: skip
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.self_attn = Attention(arch, backend, rotary, ops, tp, quantization, window)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.mlp = SparseMoeBlock(arch, ops, tp, quantization) if sparse else MLP(arch, ops, tp, quantization)

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.post_attention_layernorm(self.self_attn.o_proj(attn_out), residual)
        return self.mlp(x), residual


class MoeModel(llama.LlamaModel):
    """Llama's model (forward, sampled rows, CUDA-graph pieces) over MoE layers."""

    def __init__(self, arch: MoeArch, backend: AttentionBackend, max_positions: int, ops: LayerOps, tp: TPGroup,
                 quantization: str | None = None) -> None:  # fmt: skip
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp)
        self.rotary = RotaryEmbedding(arch.head_dim, max_positions, arch.rope, ops)
        shard = local_arch(arch, tp.world_size, tp.expert_parallel)
        self.layers = nn.ModuleList(
            MoeDecoderLayer(
                shard, backend, self.rotary, ops, tp, quantization, arch.layer_window(i), arch.sparse_layers[i]
            )  # fmt: skip
            for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)


_PER_EXPERT = re.compile(
    r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)"
    r"\.(weight|weight_scale|weight_scale_inv|input_scale)"
)
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")
# one part of every expert stacked, `[E, I, H]` or down `[E, H, I]` (GGUF's ffn_*_exps: model/moe_gguf.py)
_STACKED_PART = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)(?:\.weight)?")
_SCALE = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)_scale")


class MoeForCausalLM(LlamaForCausalLM):
    """The Llama causal LM's loading and logits over a MoE model; the experts' tensors load here."""

    model_class = MoeModel

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name as this model's parameters spell it (a family may rename)."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        experts: set[str] = set()

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = self.checkpoint_name(name)
                if not self._load_expert(name, tensor, experts):
                    yield name, tensor

        rest = others()
        if self.arch.expert_block_shape:  # the dense projections' block scales: per channel (fp8_blocks.py)
            rest = merge_block_scales(rest, self.arch.expert_block_shape)
        return super().load_weights(rest) | experts

    def _load_expert(self, name: str, tensor: torch.Tensor, loaded: set[str]) -> bool:
        """Copy `tensor` (this rank's part of it) if it is an expert's, per expert or stacked; False
        if it is not one. Shapes are checked whole, against the config, on every rank."""
        a, local = self.arch, self.shard
        inter, inter_local = a.moe_intermediate_size, local.moe_intermediate_size
        split = self.tp.world_size > 1 and not self.tp.expert_parallel  # every expert's width split
        if match := _PER_EXPERT.fullmatch(name):
            prefix, expert, part, kind = match.group(1), int(match.group(2)), match.group(3), match.group(4)
            target = f"{prefix}.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}"
            param = self._expert_param(name, target)
            if expert >= a.num_experts:
                raise KeyError(f"checkpoint tensor {name!r}: expert {expert}, but the config has {a.num_experts} "
                               "experts")  # fmt: skip
            down = part == "down_proj"
            whole = (a.hidden_size, inter) if down else (inter, a.hidden_size)
            if kind == "weight":
                self._check_expert_shape(name, tensor, whole)
            else:
                tensor = self._checked_scale(name, kind, tensor, whole, param)
            first = self._first_expert()
            if not first <= expert < first + param.shape[0]:  # another rank's expert
                return True
            j = 0 if part in ("gate_proj", "down_proj") else 1
            key = f"{target}#{expert}" if down else f"{target}#{expert}.{j}"
            if kind != "weight":
                self._copy_expert_scale(target, expert - first, j, down, tensor, split)
                loaded.add(key.replace("#", "_scale#"))
                return True
            if split:
                tensor = rank_slice(tensor, 1 if down else 0, inter_local, self.tp.rank)
            rows = slice(None) if down else slice(j * inter_local, (j + 1) * inter_local)
            if self._copy_expert(target, expert - first, rows, tensor):
                loaded.add(key.replace("#", "_scale#"))
            loaded.add(key)
            return True
        if match := _STACKED_PART.fullmatch(name):  # each expert's slice loads as its own tensor would
            part = match.group(2)
            whole = (a.hidden_size, inter) if part == "down_proj" else (inter, a.hidden_size)
            self._expert_param(name, f"{match.group(1)}.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}")
            self._check_expert_shape(name, tensor, (a.num_experts, *whole))
            for e in range(a.num_experts):
                self._load_expert(f"{match.group(1)}.{e}.{part}.weight", tensor[e], loaded)
            return True
        if match := _STACKED.fullmatch(name):
            param = self._expert_param(name, name)
            down = match.group(2) == "down_proj"
            whole = (a.num_experts, a.hidden_size, inter) if down else (a.num_experts, 2 * inter, a.hidden_size)
            self._check_expert_shape(name, tensor, whole)
            first = self._first_expert()
            tensor = tensor.narrow(0, first, param.shape[0])
            if split and down:
                tensor = rank_slice(tensor, 2, inter_local, self.tp.rank)
            elif split:
                gate, up = tensor.chunk(2, dim=1)
                tensor = torch.cat([rank_slice(gate, 1, inter_local, self.tp.rank),
                                    rank_slice(up, 1, inter_local, self.tp.rank)], dim=1)  # fmt: skip
            quantized = [self._copy_expert(name, e, slice(None), tensor[e]) for e in range(param.shape[0])]
            loaded.update(self._expert_keys(name) | (self._expert_keys(name + "_scale") if any(quantized) else set()))
            return True
        return False

    def _first_expert(self) -> int:
        """The first expert this rank holds (expert parallelism: rank r holds r * E/world ...)."""
        return self.tp.rank * self.shard.local_experts

    def _copy_expert(self, target: str, expert: int, rows: slice, tensor: torch.Tensor) -> bool:
        """Rows `rows` of local expert `expert` of the stacked parameter `target`: `tensor` as it is
        (16-bit, or an FP8 checkpoint's, whose scale comes apart), or quantized to FP8 with its
        scales per row or per block (then True: the scales are set too)."""
        param = self.get_parameter(target)
        dest = param.data[expert, rows]
        if param.dtype != FP8 or tensor.dtype == FP8:
            if tensor.dtype == FP8 and param.dtype != FP8:
                raise ValueError(f"{target}: an FP8 expert tensor, but the experts run in {param.dtype}")
            dest.copy_(tensor)
            return False
        scale = self.get_parameter(f"{target}_scale").data[expert]
        block = self.arch.expert_block_shape
        if block is None:
            q, row_scales = quantize_rows(tensor)
            scale[rows].copy_(row_scales)
        else:  # the width is a multiple of bn: gate and up rows never share a block
            q, block_scales = quantize_blocks(tensor, block)
            first = (rows.start or 0) // block[0]
            scale[first : first + block_scales.shape[0]].copy_(block_scales)
        dest.copy_(q)
        return True

    def _checked_scale(self, name: str, kind: str, tensor: torch.Tensor, whole: tuple[int, int],
                       param: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """An FP8 checkpoint's scale of an expert's weight of shape `whole`, checked against it and the
        config, in float32: per channel as `[rows, 1]` (one per tensor repeated), per block as its grid."""
        block = self.arch.expert_block_shape
        if kind == "input_scale":
            raise ValueError(f"checkpoint tensor {name!r}: a static activation scale for an expert; the experts "
                             "quantize their tokens per token (dynamic activations) only")  # fmt: skip
        if param.dtype != FP8:
            raise ValueError(f"checkpoint tensor {name!r}: an FP8 scale, but the experts run in {param.dtype}")
        if kind == "weight_scale_inv":
            if block is None:
                raise ValueError(f"checkpoint tensor {name!r}: a block scale, but the config's quantization_config "
                                 "gives no weight_block_size")  # fmt: skip
            check_block_scale(name, tensor, whole, block)
            return tensor.to(torch.float32)
        if block is not None:
            raise ValueError(f"checkpoint tensor {name!r}: a scale per tensor or channel, but the config's "
                             f"weight_block_size {list(block)} asks for block scales ({BLOCK_SCALE_SUFFIX[1:]})")  # fmt: skip
        rows = whole[0]
        if tensor.numel() == 1:
            return tensor.reshape(1, 1).to(torch.float32).expand(rows, 1)
        if tuple(tensor.shape) not in ((rows,), (rows, 1)):
            raise ValueError(f"checkpoint tensor {name!r}: shape {tuple(tensor.shape)}, but a weight of {whole} takes "
                             f"one scale (per tensor) or ({rows}, 1) (per output channel)")  # fmt: skip
        return tensor.reshape(rows, 1).to(torch.float32)

    def _copy_expert_scale(self, target: str, expert: int, j: int, down: bool, scale: torch.Tensor,
                           split: bool) -> None:  # fmt: skip
        """A checked checkpoint scale (`_checked_scale`) into local expert `expert`'s scales of
        `target` (`j`: gate 0, up 1), this rank's part of it under tensor parallelism: the rows
        (or block rows) of its gate and up slices, the columns' blocks of its down slice."""
        dest = self.get_parameter(f"{target}_scale").data[expert]
        block = self.arch.expert_block_shape
        inter_local = self.shard.moe_intermediate_size
        if down:
            if split and block is not None:  # the columns split: their blocks
                scale = rank_slice(scale, 1, inter_local // block[1], self.tp.rank)
            dest.copy_(scale)
            return
        size = inter_local if block is None else inter_local // block[0]
        if split:
            scale = rank_slice(scale, 0, size, self.tp.rank)
        dest[j * size : (j + 1) * size].copy_(scale)

    def _expert_param(self, name: str, target: str) -> nn.Parameter:
        try:
            return self.get_parameter(target)
        except AttributeError:  # no such layer, or a dense one
            raise KeyError(f"checkpoint tensor {name!r} has no place in {self.arch.architecture} (layer without "
                           "experts, or past the last layer)") from None  # fmt: skip

    def _check_expert_shape(self, name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
        if tuple(tensor.shape) != tuple(shape):
            a = self.arch
            raise ValueError(f"checkpoint tensor {name!r}: shape {tuple(tensor.shape)}, but the config's experts "
                             f"take {tuple(shape)} (num_experts {a.num_experts}, hidden_size {a.hidden_size}, "
                             f"expert intermediate size {a.moe_intermediate_size})")  # fmt: skip

    def _expert_keys(self, param_name: str) -> set[str]:
        """What loading a stacked expert parameter fully gives on this rank (expected_weight_keys' names,
        by the experts' global index)."""
        first = self._first_expert()
        experts = range(first, first + self.get_parameter(param_name).shape[0])
        if ".gate_up_proj" in param_name:  # its scales too
            return {f"{param_name}#{e}.{j}" for e in experts for j in (0, 1)}
        return {f"{param_name}#{e}" for e in experts}

    def expected_weight_keys(self) -> set[str]:
        keys = super().expected_weight_keys()
        for name in [k for k in keys if _STACKED.fullmatch(k) or _SCALE.fullmatch(k)]:
            keys.remove(name)  # an FP8 expert's scales: from the checkpoint, or set as its weight is quantized
            keys |= self._expert_keys(name)
        return keys

    def fused_widths(self, target: str) -> list[int]:
        if ".shared_expert." in target:  # its gate and up rows: the shared expert's width each
            return [self.shard.shared_expert_intermediate_size] * 2
        return super().fused_widths(target)

    def lora_consumers(self) -> list[tuple[nn.Module, nn.Module, str]]:
        raise NotImplementedError("MoE models refuse LoRA (FAMILY.unsupported)")


# ---- what the families declare (model/interface.py) ----


def parse_moe_config(
    cfg: dict, architecture: str, family: str, *, num_experts: int, top_k: int, moe_intermediate_size: int,
    norm_topk_prob: bool, sparse_layers: tuple[bool, ...], attention_bias: bool, o_proj_bias: bool, qk_norm: bool,
    sliding_window: int | None = None, shared_expert_intermediate_size: int = 0,
) -> MoeArch:  # fmt: skip
    """A MoE config.json's common keys, and the experts' shape the family read."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{architecture} with hidden_act {cfg.get('hidden_act')!r} is not supported")
    if not 1 <= top_k <= num_experts:
        raise UnsupportedModelError(f"{architecture}: {top_k} experts per token (num_experts_per_tok) of "
                                    f"{num_experts} experts")  # fmt: skip
    num_heads = cfg["num_attention_heads"]
    return MoeArch(
        architecture=architecture,
        family=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg.get("intermediate_size") or moe_intermediate_size,
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rope=parse_rope(cfg),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=attention_bias,
        o_proj_bias=o_proj_bias,
        qk_norm=qk_norm,
        mlp_bias=False,
        sliding_window=sliding_window,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_token_ids(cfg),
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate_size=moe_intermediate_size,
        norm_topk_prob=norm_topk_prob,
        shared_expert_intermediate_size=shared_expert_intermediate_size,
        sparse_layers=sparse_layers,
        expert_block_shape=fp8_block_shape(cfg),
    )


def fp8_block_shape(cfg: dict) -> tuple[int, int] | None:
    """An FP8 checkpoint's weight scale blocks (`quant_method: fp8` with `weight_block_size`), or None."""
    qc = cfg.get("quantization_config") or {}
    block = qc.get("weight_block_size") if qc.get("quant_method") == "fp8" else None
    if not block:
        return None
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise UnsupportedModelError(f"quantization_config weight_block_size {block!r}: two positive integers expected")
    return int(block[0]), int(block[1])


def num_experts(cfg: dict, default: int) -> int:
    """The expert count: `num_experts` as Qwen publishes it, `num_local_experts` as Mixtral does
    (and as transformers 5 writes both)."""
    return int(cfg.get("num_experts", cfg.get("num_local_experts", default)))


def qwen_sparse_layers(cfg: dict) -> tuple[bool, ...]:
    """Qwen-MoE's sparse layers: every `decoder_sparse_step`-th, except `mlp_only_layers`."""
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    experts = num_experts(cfg, 0)
    return tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(cfg["num_hidden_layers"]))


def moe_linears(arch: MoeArch) -> tuple[LinearSpec, ...]:
    """Llama's attention projections on every layer (not LoRA-capable yet), and its dense MLP's on
    the layers without experts."""
    dense = tuple(i for i, sparse in enumerate(arch.sparse_layers) if not sparse)
    specs = []
    for spec in llama.linear_specs(arch):
        if spec.parent == "self_attn":
            specs.append(dataclasses.replace(spec, lora=False))
        elif dense:
            specs.append(dataclasses.replace(spec, lora=False, layers=dense))
    return tuple(specs)


def expert_specs(arch: MoeArch) -> tuple[ExpertSpec | None, ...]:
    """Each layer's experts (None: a dense layer)."""
    spec = ExpertSpec(arch.num_experts, arch.top_k, arch.hidden_size, arch.moe_intermediate_size,
                      arch.shared_expert_intermediate_size)  # fmt: skip
    return tuple(spec if sparse else None for sparse in arch.sparse_layers)


def build(arch: MoeArch, *args, **kwargs) -> MoeForCausalLM:
    return MoeForCausalLM(arch, *args, **kwargs)
