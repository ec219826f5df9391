"""Mixtral (`MixtralForCausalLM`: Mixtral-8x7B, 8x22B): Mistral's attention (a sliding window on
every layer where `sliding_window` is set) and on every layer a sparse MoE block
(model/moe_block.py): `num_local_experts` experts (8), `num_experts_per_tok` a token (2), their
weights always renormalised. Checkpoints name the block `block_sparse_moe` and an expert's gate, down
and up projections `w1`, `w2`, `w3`; they load under the shared block's names.
"""

from __future__ import annotations

import re

from llmserve.model import moe_block
from llmserve.model.interface import ModelFamily
from llmserve.model.llama import attention_specs
from llmserve.model.moe_block import MoeArch, MoeForCausalLM

_EXPERT_PART = re.compile(r"(\.experts\.\d+)\.w([123])\.")
_PARTS = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


class MixtralForCausalLM(MoeForCausalLM):
    def checkpoint_name(self, name: str) -> str:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return _EXPERT_PART.sub(lambda m: f"{m.group(1)}.{_PARTS[m.group(2)]}.", name)


def parse_config(cfg: dict) -> MoeArch:
    window = cfg.get("sliding_window")
    experts = moe_block.num_experts(cfg, 8)
    return moe_block.parse_moe_config(
        cfg, "MixtralForCausalLM", "mixtral", num_experts=experts, top_k=cfg.get("num_experts_per_tok", 2),
        moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True,
        sparse_layers=(True,) * cfg["num_hidden_layers"], attention_bias=False, o_proj_bias=False, qk_norm=False,
        sliding_window=int(window) if window else None,
    )  # fmt: skip


FAMILY = ModelFamily(
    name="Mixtral",
    architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    gguf_architectures=(),
    parse_config=parse_config,
    build=lambda arch, *args, **kwargs: MixtralForCausalLM(arch, *args, **kwargs),
    linears=moe_block.moe_linears,
    attention=attention_specs,
    experts=moe_block.expert_specs,
    unsupported=moe_block.UNSUPPORTED,
)
