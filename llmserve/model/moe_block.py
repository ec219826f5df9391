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
against the config. Experts are not `LinearSpec`s: the families refuse LoRA, FP8 and tensor
parallelism for now.
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
from llmserve.model.interface import LinearSpec
from llmserve.model.layers import LayerOps, RMSNorm, RotaryEmbedding
from llmserve.model.llama import MLP, Attention, LlamaForCausalLM
from llmserve.model.tensor_parallel import TPGroup, VocabParallelEmbedding, local_arch


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


# the features every MoE family refuses for now (FAMILY.unsupported), by `EngineArgs`' names
UNSUPPORTED = {
    "lora": "the experts are not LoRA-capable linear layers and adapters on the attention projections "
    "alone are not wired for MoE models yet",
    "quantization": "FP8 experts (and FP8 MoE checkpoints) are not implemented yet; serve the 16-bit weights",
    "tensor_parallel": "the experts are not split over ranks yet (tensor and expert parallelism come later)",
}


class Experts(nn.Module):
    """E gated MLPs' weights, stacked: gate and up rows `[E, 2 * I, H]` (gate first), down `[E, H, I]`."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter), requires_grad=False)


class SparseMoeBlock(nn.Module):
    """router -> top-k experts -> weighted sum (+ the shared expert, sigmoid-gated)."""

    def __init__(self, arch: MoeArch, ops: LayerOps, tp: TPGroup) -> None:
        super().__init__()
        self.top_k = arch.top_k
        self.renormalize = arch.norm_topk_prob
        self.fused_moe = ops.fused_moe
        self.gate = nn.Linear(arch.hidden_size, arch.num_experts, bias=False)  # the router
        self.experts = Experts(arch.num_experts, arch.hidden_size, arch.moe_intermediate_size)
        self.shared_expert = self.shared_expert_gate = None
        if arch.shared_expert_intermediate_size:
            shared = dataclasses.replace(arch, intermediate_size=arch.shared_expert_intermediate_size)
            self.shared_expert = MLP(shared, ops, tp)
            self.shared_expert_gate = nn.Linear(arch.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.gate.weight)
        out = self.fused_moe(x, logits, self.experts.gate_up_proj, self.experts.down_proj, self.top_k,
                             self.renormalize)  # fmt: skip
        if self.shared_expert is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x)
        return out


class MoeDecoderLayer(llama.DecoderLayer):
    """Llama's layer (forward, sampled rows, the part before attention) with the MoE block as its MLP."""

    def __init__(self, arch: MoeArch, backend: AttentionBackend, rotary: RotaryEmbedding, ops: LayerOps,
                 tp: TPGroup, quantization: str | None, window: int | None, sparse: bool) -> None:  # fmt: skip
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.self_attn = Attention(arch, backend, rotary, ops, tp, quantization, window)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.mlp = SparseMoeBlock(arch, ops, tp) if sparse else MLP(arch, ops, tp, quantization)

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
        shard = local_arch(arch, tp.world_size)
        self.layers = nn.ModuleList(
            MoeDecoderLayer(
                shard, backend, self.rotary, ops, tp, quantization, arch.layer_window(i), arch.sparse_layers[i]
            )  # fmt: skip
            for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)


_PER_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")


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
        """Copy `tensor` if it is an expert's (per expert or stacked); False if it is not one."""
        a = self.arch
        inter = a.moe_intermediate_size
        if match := _PER_EXPERT.fullmatch(name):
            prefix, expert, part = match.group(1), int(match.group(2)), match.group(3)
            target = f"{prefix}.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}"
            param = self._expert_param(name, target)
            if expert >= a.num_experts:
                raise KeyError(f"checkpoint tensor {name!r}: expert {expert}, but the config has {a.num_experts} "
                               "experts")  # fmt: skip
            if part == "down_proj":
                dest, key = param.data[expert], f"{target}#{expert}"
            else:
                j = 0 if part == "gate_proj" else 1
                dest, key = param.data[expert, j * inter : (j + 1) * inter], f"{target}#{expert}.{j}"
            self._check_expert_shape(name, tensor, dest.shape)
            dest.copy_(tensor)
            loaded.add(key)
            return True
        if match := _STACKED.fullmatch(name):
            param = self._expert_param(name, name)
            self._check_expert_shape(name, tensor, param.shape)
            param.data.copy_(tensor)
            loaded.update(self._expert_keys(name))
            return True
        return False

    def _expert_param(self, name: str, target: str) -> nn.Parameter:
        try:
            return self.get_parameter(target)
        except AttributeError:  # no such layer, or a dense one
            raise KeyError(f"checkpoint tensor {name!r} has no place in {self.arch.architecture} (layer without "
                           "experts, or past the last layer)") from None  # fmt: skip

    def _check_expert_shape(self, name: str, tensor: torch.Tensor, shape: torch.Size) -> None:
        if tuple(tensor.shape) != tuple(shape):
            a = self.arch
            raise ValueError(f"checkpoint tensor {name!r}: shape {tuple(tensor.shape)}, but the config's experts "
                             f"take {tuple(shape)} (num_experts {a.num_experts}, hidden_size {a.hidden_size}, "
                             f"expert intermediate size {a.moe_intermediate_size})")  # fmt: skip

    def _expert_keys(self, param_name: str) -> set[str]:
        """What loading a stacked expert parameter fully gives (expected_weight_keys' names)."""
        experts = range(self.arch.num_experts)
        if param_name.endswith(".gate_up_proj"):
            return {f"{param_name}#{e}.{j}" for e in experts for j in (0, 1)}
        return {f"{param_name}#{e}" for e in experts}

    def expected_weight_keys(self) -> set[str]:
        keys = super().expected_weight_keys()
        for name in [k for k in keys if _STACKED.fullmatch(k)]:
            keys.remove(name)
            keys |= self._expert_keys(name)
        return keys

    def _shard_view(self, target: str, param: torch.Tensor, shard: int) -> torch.Tensor:
        if ".shared_expert." in target:  # its gate and up rows: the shared expert's width each
            size = self.shard.shared_expert_intermediate_size
            return param.data.narrow(0, shard * size, size)
        return super()._shard_view(target, param, shard)

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


def attention_linears(arch: ModelArch) -> tuple[LinearSpec, ...]:
    """The attention projections, Llama's (the experts are not linear layers of the interface),
    neither LoRA- nor FP8-capable yet."""
    specs = [s for s in llama.linear_specs(arch) if s.parent == "self_attn"]
    return tuple(dataclasses.replace(s, lora=False, fp8=False) for s in specs)


def build(arch: MoeArch, *args, **kwargs) -> MoeForCausalLM:
    return MoeForCausalLM(arch, *args, **kwargs)
