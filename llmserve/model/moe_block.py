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
ranks by one all-reduce, as the dense MLP's down projection is. `--quantization fp8`: the experts'
weights in FP8 E4M3 with a float32 scale per output channel (each rank quantizes its own slice),
tokens quantized per token; they run the PyTorch reference (the fused kernels take 16-bit weights).
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
    "fp8_triton": "FP8 experts run only the PyTorch reference so far (attention_backend reference, on CPU); "
    "the fused MoE kernels take 16-bit weights",
    "fp8_checkpoint": "the experts' FP8 tensors and scales of a quantized checkpoint are not read yet; serve the "
    "16-bit checkpoint with --quantization fp8",
}


class Experts(nn.Module):
    """E gated MLPs' weights, stacked: gate and up rows `[E, 2 * I, H]` (gate first), down `[E, H, I]`;
    in FP8 with a float32 scale per output row (`gate_up_proj_scale [E, 2 * I, 1]`, `down_proj_scale`)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, fp8: bool = False) -> None:
        super().__init__()
        dtype = {"dtype": FP8} if fp8 else {}
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden, **dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter, **dtype), requires_grad=False)
        self.gate_up_proj_scale = self.down_proj_scale = None
        if fp8:
            f32 = torch.float32
            self.gate_up_proj_scale = nn.Parameter(torch.empty(num_experts, 2 * inter, 1, dtype=f32), False)
            self.down_proj_scale = nn.Parameter(torch.empty(num_experts, hidden, 1, dtype=f32), False)

    def scales(self) -> dict[str, torch.Tensor]:
        """The FP8 scales as `fused_moe` takes them (none for 16-bit experts)."""
        if self.gate_up_proj_scale is None:
            return {}
        return {"w13_scale": self.gate_up_proj_scale, "w2_scale": self.down_proj_scale}

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
        self.experts = Experts(arch.held_experts, arch.hidden_size, arch.moe_intermediate_size, quantization == "fp8")
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


_PER_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")
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

        return super().load_weights(others()) | experts

    def _load_expert(self, name: str, tensor: torch.Tensor, loaded: set[str]) -> bool:
        """Copy `tensor` (this rank's part of it) if it is an expert's, per expert or stacked; False
        if it is not one. Shapes are checked whole, against the config, on every rank."""
        a, local = self.arch, self.shard
        inter, inter_local = a.moe_intermediate_size, local.moe_intermediate_size
        split = self.tp.world_size > 1 and not self.tp.expert_parallel  # every expert's width split
        if match := _PER_EXPERT.fullmatch(name):
            prefix, expert, part = match.group(1), int(match.group(2)), match.group(3)
            target = f"{prefix}.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}"
            param = self._expert_param(name, target)
            if expert >= a.num_experts:
                raise KeyError(f"checkpoint tensor {name!r}: expert {expert}, but the config has {a.num_experts} "
                               "experts")  # fmt: skip
            down = part == "down_proj"
            self._check_expert_shape(name, tensor, (a.hidden_size, inter) if down else (inter, a.hidden_size))
            first = self._first_expert()
            if not first <= expert < first + param.shape[0]:  # another rank's expert
                return True
            if split:
                tensor = rank_slice(tensor, 1 if down else 0, inter_local, self.tp.rank)
            j = 0 if part in ("gate_proj", "down_proj") else 1
            rows = slice(None) if down else slice(j * inter_local, (j + 1) * inter_local)
            self._copy_expert(target, expert - first, rows, tensor)
            loaded.add(f"{target}#{expert}" if down else f"{target}#{expert}.{j}")
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
            for e in range(param.shape[0]):
                self._copy_expert(name, e, slice(None), tensor[e])
            loaded.update(self._expert_keys(name))
            return True
        return False

    def _first_expert(self) -> int:
        """The first expert this rank holds (expert parallelism: rank r holds r * E/world ...)."""
        return self.tp.rank * self.shard.local_experts

    def _copy_expert(self, target: str, expert: int, rows: slice, tensor: torch.Tensor) -> None:
        """Rows `rows` of local expert `expert` of the stacked parameter `target`: `tensor` as it is,
        or in FP8 with its scale per row."""
        param = self.get_parameter(target)
        dest = param.data[expert, rows]
        if tensor.dtype == FP8:  # refused at start (UNSUPPORTED["fp8_checkpoint"]); never requantized
            raise ValueError(f"{target}: FP8 expert tensors are not read yet")
        if param.dtype == FP8:
            q, scale = quantize_rows(tensor)
            dest.copy_(q)
            self.get_parameter(f"{target}_scale").data[expert, rows].copy_(scale)
        else:
            dest.copy_(tensor)

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
        if param_name.endswith(".gate_up_proj"):
            return {f"{param_name}#{e}.{j}" for e in experts for j in (0, 1)}
        return {f"{param_name}#{e}" for e in experts}

    def expected_weight_keys(self) -> set[str]:
        keys = super().expected_weight_keys()
        for name in [k for k in keys if _STACKED.fullmatch(k) or _SCALE.fullmatch(k)]:
            keys.remove(name)
            if not _SCALE.fullmatch(name):  # an FP8 expert's scales come with its weights
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
    )


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
