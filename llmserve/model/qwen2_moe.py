"""Qwen2-MoE (`Qwen2MoeForCausalLM`: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v
bias, `qkv_bias`) and a sparse MoE block in place of the MLP (model/moe_block.py) with a shared
expert every token passes, its output scaled by sigmoid(`shared_expert_gate`(x)) and added to the
routed experts'. `norm_topk_prob` is off in the published models. Layers in `mlp_only_layers`, and
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
        raise UnsupportedModelError("Qwen2MoeForCausalLM with use_sliding_window is not supported")
    return moe_block.parse_moe_config(
        cfg, "Qwen2MoeForCausalLM", "qwen2_moe", num_experts=moe_block.num_experts(cfg, 60),
        top_k=cfg.get("num_experts_per_tok", 4), moe_intermediate_size=cfg.get("moe_intermediate_size", 1408),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), sparse_layers=moe_block.qwen_sparse_layers(cfg),
        attention_bias=bool(cfg.get("qkv_bias", True)), o_proj_bias=False, qk_norm=False,
        shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 5632),
    )  # fmt: skip


FAMILY = ModelFamily(
    name="Qwen2-MoE",
    architectures=("Qwen2MoeForCausalLM",),
    model_types=("qwen2_moe",),
    gguf_architectures=("qwen2moe",),
    parse_config=parse_config,
    build=moe_block.build,
    linears=moe_block.moe_linears,
    attention=attention_specs,
    experts=moe_block.expert_specs,
    unsupported=moe_block.UNSUPPORTED,
    gguf_config=moe_gguf.gguf_config,
    gguf_tensor_name=gguf_name_mapper(GGUF_GLOBAL, {**GGUF_LAYER, **moe_gguf.GGUF_EXPERT_LAYER}, "Qwen2-MoE"),
    gguf_tensor_values=moe_gguf.gguf_tensor_values,
)
