"""Qwen3-MoE (`Qwen3MoeForCausalLM`: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k RMSNorm
per head, no q/k/v bias unless `attention_bias`) and a sparse MoE block in place of the MLP
(model/moe_block.py): `num_experts` experts (128 in the published models), `num_experts_per_tok` of
them a token (8), their weights renormalised when `norm_topk_prob`. Layers in `mlp_only_layers`, and
all but every `decoder_sparse_step`-th, keep a dense MLP of `intermediate_size`.
"""

from __future__ import annotations

from llmserve.model import moe_block, moe_gguf
from llmserve.model.arch import UnsupportedModelError
from llmserve.model.interface import ModelFamily
from llmserve.model.llama import GGUF_GLOBAL, GGUF_LAYER, attention_specs, gguf_name_mapper
from llmserve.model.moe_block import MoeArch


def parse_config(cfg: dict) -> MoeArch:
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelError("Qwen3MoeForCausalLM with use_sliding_window is not supported")
    bias = bool(cfg.get("attention_bias", False))
    return moe_block.parse_moe_config(
        cfg, "Qwen3MoeForCausalLM", "qwen3_moe", num_experts=moe_block.num_experts(cfg, 128),
        top_k=cfg.get("num_experts_per_tok", 8), moe_intermediate_size=cfg.get("moe_intermediate_size", 768),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), sparse_layers=moe_block.qwen_sparse_layers(cfg),
        attention_bias=bias, o_proj_bias=bias, qk_norm=True,
    )  # fmt: skip


FAMILY = ModelFamily(
    name="Qwen3-MoE",
    architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    gguf_architectures=("qwen3moe",),
    parse_config=parse_config,
    build=moe_block.build,
    linears=moe_block.moe_linears,
    attention=attention_specs,
    experts=moe_block.expert_specs,
    unsupported=moe_block.UNSUPPORTED,
    gguf_config=moe_gguf.gguf_config,
    gguf_tensor_name=gguf_name_mapper(GGUF_GLOBAL, {**GGUF_LAYER, **moe_gguf.GGUF_EXPERT_LAYER}, "Qwen3-MoE"),
    gguf_tensor_values=moe_gguf.gguf_tensor_values,
)
