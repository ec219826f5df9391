"""Mixtures of experts from GGUF files (llama.cpp's layout): the `qwen3moe` and `qwen2moe`
architectures, and `llama` with experts (Mixtral, which llama.cpp writes as llama).

llama.cpp keeps a layer's experts as three 3-D tensors, `blk.N.ffn_gate_exps` and
`ffn_up_exps` `[E, I, H]` and `ffn_down_exps` `[E, H, I]` (PyTorch order), and the router as
`ffn_gate_inp` `[E, H]`; Qwen2-MoE's shared expert as `ffn_{gate,up,down}_shexp` and its gate as
`ffn_gate_inp_shexp` `[H]` (one row, stored flat). They load under Hugging Face names: each part
stacked (`mlp.experts.gate_proj` `[E, I, H]`, model/moe_block.py splits it per expert, checking its
shape), the router `mlp.gate`. The experts' shape comes from the metadata (`expert_count`,
`expert_used_count`, `expert_feed_forward_length`), else from the tensors; older files with one
tensor per expert (`blk.N.ffn_gate.E.weight`) or any other layout are refused, naming the tensor.
"""

from __future__ import annotations

from llmserve.model.arch import UnsupportedModelError

# llama.cpp's names of a MoE layer's tensors -> the Hugging Face names (inside model.layers.N.)
GGUF_EXPERT_LAYER = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_ARCHITECTURES = {"qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "llama": "MixtralForCausalLM"}


def has_experts(ckpt) -> bool:
    """A GGUF whose metadata or first layer says it has experts (Mixtral's says `llama`)."""
    return bool(ckpt.arch_key("expert_count")) or "blk.0.ffn_gate_inp.weight" in ckpt.tensors


def _refuse(ckpt, why: str) -> UnsupportedModelError:
    from llmserve.model.gguf.checkpoint import GGUFError

    return GGUFError(f"{str(ckpt.path)!r}: {why}")


def _sparse_layers(ckpt, layers: int) -> list[bool]:
    """Which layers hold experts (`ffn_gate_exps`); a layer with neither experts nor a dense MLP, or
    with experts in another layout (one tensor per expert), is refused naming its tensor."""
    sparse = []
    for i in range(layers):
        stacked = f"blk.{i}.ffn_gate_exps.weight" in ckpt.tensors
        per_expert = next((n for n in ckpt.tensors if n.startswith(f"blk.{i}.ffn_gate.") and n[-7:] == ".weight"
                           and n.split(".")[3].isdigit()), None)  # fmt: skip
        if per_expert is not None:
            raise _refuse(ckpt, f"GGUF tensor {per_expert!r}: experts stored one tensor each (an older llama.cpp "
                                "layout); llmserve reads them stacked (blk.N.ffn_gate_exps/ffn_up_exps/ffn_down_exps), "
                                "as llama.cpp writes them since 2024: convert the model again")  # fmt: skip
        if not stacked and f"blk.{i}.ffn_gate.weight" not in ckpt.tensors:
            found = sorted(n for n in ckpt.tensors if n.startswith(f"blk.{i}.ffn"))
            raise _refuse(ckpt, f"layer {i} has neither stacked experts (blk.{i}.ffn_gate_exps.weight) nor a dense MLP "
                                f"(blk.{i}.ffn_gate.weight); its feed-forward tensors: {', '.join(found) or 'none'}")  # fmt: skip
        sparse.append(stacked)
    return sparse


def _expert_shape(ckpt, first: int) -> tuple[int, int]:
    """(experts, expert width) from layer `first`'s `ffn_gate_exps` `[E, I, H]`, checked against
    the metadata where it gives them."""
    name = f"blk.{first}.ffn_gate_exps.weight"
    shape = ckpt.tensors[name].shape
    if len(shape) != 3:
        raise _refuse(ckpt, f"GGUF tensor {name!r} has shape {shape}; stacked experts are [experts, width, hidden]")
    experts, width = int(shape[0]), int(shape[1])
    for key, value in (("expert_count", experts), ("expert_feed_forward_length", width)):
        said = ckpt.arch_key(key)
        if said is not None and int(said) != value:
            raise _refuse(ckpt, f"GGUF tensor {name!r} holds {value} for {ckpt.architecture}.{key}, which says {said}")
    return experts, width


def gguf_config(ckpt, config: dict) -> dict:
    """The MoE keys of the Hugging Face config a GGUF describes (its family's `gguf_config`)."""
    arch = ckpt.architecture
    layers = config["num_hidden_layers"]
    sparse = _sparse_layers(ckpt, layers)
    if not any(sparse):
        raise _refuse(ckpt, "a mixture-of-experts architecture without experts (no blk.N.ffn_gate_exps tensor)")
    experts, width = _expert_shape(ckpt, sparse.index(True))
    used = ckpt.arch_key("expert_used_count")
    if used is None:
        raise _refuse(ckpt, f"the metadata lacks {arch}.expert_used_count (experts per token)")
    out = {**config, "architectures": [_ARCHITECTURES[arch]], "num_experts_per_tok": int(used)}
    if arch == "llama":  # Mixtral: every layer sparse, the experts' width is intermediate_size
        if not all(sparse):
            raise _refuse(
                ckpt, f"layer {sparse.index(False)} of a llama GGUF with experts has none (Mixtral's layers all do)"
            )
        return {**out, "num_local_experts": experts, "intermediate_size": width}
    out.update(num_experts=experts, moe_intermediate_size=width, decoder_sparse_step=1,
               mlp_only_layers=[i for i, s in enumerate(sparse) if not s])  # fmt: skip
    if arch == "qwen3moe":  # llama.cpp renormalises the chosen experts' weights, as Qwen3-MoE does
        return {**out, "norm_topk_prob": True, "attention_bias": "blk.0.attn_q.bias" in ckpt.tensors}
    shared = ckpt.tensors.get(f"blk.{sparse.index(True)}.ffn_up_shexp.weight")
    return {**out, "norm_topk_prob": False, "qkv_bias": "blk.0.attn_q.bias" in ckpt.tensors,
            "shared_expert_intermediate_size": int(shared.shape[0]) if shared is not None else 0}  # fmt: skip


def gguf_tensor_values(hf_name: str, tensor, arch, gguf_arch: str):
    """Qwen2-MoE's shared expert gate, stored flat, as its one row."""
    if hf_name.endswith(".shared_expert_gate.weight") and tensor.dim() == 1:
        return tensor.reshape(1, -1)
    return tensor
