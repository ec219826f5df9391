"""Write a Hugging Face model folder as a GGUF file (llama.cpp's layout), for tests and tools.

The inverse of gguf/config.py and gguf/weights.py: metadata under the GGUF architecture's
names, tensors renamed, q/k rows of the `llama` architecture reordered as llama.cpp does,
matrices in the asked tensor type (norms and biases stay F32, as llama.cpp keeps them),
and the tokenizer (byte-level BPE: tokens, merges, special ids, chat template). A mixture of
experts' experts stacked per part (`ffn_gate_exps` ...: model/moe_gguf.py), their counts in the
metadata; Mixtral as `llama`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from llmserve.model.arch import ModelArch, RopeConfig, read_model_arch
from llmserve.model.gguf.quantize import quantize
from llmserve.model.loader import safetensors_files

_FAMILY_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
                "qwen2_moe": "qwen2moe", "mixtral": "llama"}  # fmt: skip
_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_PARTS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    # mixtures of experts (model/moe_gguf.py): the router, the stacked experts, Qwen2-MoE's shared expert
    "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}  # fmt: skip
_PER_EXPERT = re.compile(r"(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_MIXTRAL_PARTS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_TOKEN_NORMAL, _TOKEN_CONTROL = 1, 3


def gguf_tensor_name(name: str) -> str:
    if name in _HF_TO_GGUF:
        return _HF_TO_GGUF[name]
    parts = name.split(".")  # model.layers.N.<part...>.weight|bias
    return f"blk.{parts[2]}.{_LAYER_PARTS['.'.join(parts[3:-1])]}.{parts[-1]}"


def permute_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's reordering of q/k rows (the inverse of weights.unpermute_rotary)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def llama3_rope_factors(arch: ModelArch) -> np.ndarray:
    """Llama 3.1's rope scaling as the per-frequency divisors llama.cpp stores (rope_freqs)."""
    rope: RopeConfig = arch.rope
    factors = []
    for i in range(0, arch.head_dim, 2):
        wavelen = 2 * math.pi * rope.theta ** (i / arch.head_dim)
        if wavelen < rope.original_max_position_embeddings / rope.high_freq_factor:
            factors.append(1.0)
        elif wavelen > rope.original_max_position_embeddings / rope.low_freq_factor:
            factors.append(rope.factor)
        else:
            smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
                rope.high_freq_factor - rope.low_freq_factor
            )
            factors.append(1.0 / ((1 - smooth) / rope.factor + smooth))
    return np.array(factors, dtype=np.float32)


def _tokenizer_fields(writer, model_dir: Path, arch: ModelArch) -> None:
    data = json.loads((model_dir / "tokenizer.json").read_text())
    model = data["model"]
    if model.get("type") != "BPE":
        raise ValueError("only byte-level BPE tokenizers are written to GGUF here")
    vocab = dict(model["vocab"])
    for added in data.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    size = max(arch.vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [_TOKEN_NORMAL] * size
    for token, index in vocab.items():
        tokens[index] = token
    for added in data.get("added_tokens", []):
        types[added["id"]] = _TOKEN_CONTROL if added.get("special") else _TOKEN_NORMAL
    for i, token in enumerate(tokens):
        if token.startswith("[PAD"):
            types[i] = _TOKEN_CONTROL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    by_text = {t: i for i, t in enumerate(tokens)}
    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                     ("pad_token", writer.add_pad_token_id)):  # fmt: skip
        text = config.get(key)
        text = text.get("content") if isinstance(text, dict) else text
        if text in by_text:
            add(by_text[text])
    writer.add_add_bos_token(False)
    template = config.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)


def _hf_tensors(model_dir: Path, arch: ModelArch, num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The folder's tensors in float32 under the names the GGUF tables know: the experts' (per expert,
    Mixtral's w1/w2/w3 too) stacked per part (`mlp.experts.gate_proj [E, I, H]`) once all E are read."""
    from safetensors import safe_open

    parts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for hf in f.keys():
                tensor = f.get_tensor(hf).float()
                match = _PER_EXPERT.fullmatch(hf)
                if match is None:
                    yield hf.replace(".block_sparse_moe.", ".mlp."), tensor
                    continue
                layer, expert, part = match.group(1), int(match.group(2)), match.group(3)
                key = (layer, _MIXTRAL_PARTS.get(part, part))
                parts.setdefault(key, {})[expert] = tensor
                if len(parts[key]) == num_experts:
                    experts = parts.pop(key)
                    yield f"{key[0]}.mlp.experts.{key[1]}.weight", torch.stack([experts[e] for e in range(num_experts)])
    if parts:
        raise ValueError(f"{model_dir}: experts missing from {sorted(parts)[:3]}")


def write_gguf(model_dir: str | Path, out: str | Path, tensor_type: str | Callable[[str], str] = "F32",
               tokenizer: bool = True) -> Path:  # fmt: skip
    """Write the Hugging Face folder `model_dir` (safetensors, byte-level BPE tokenizer) to
    the GGUF file `out`, its matrices in `tensor_type` (or each in the type it gives for its
    Hugging Face name: a mixed file, as Q4_K_M is) (`tokenizer=False`: no tokenizer metadata,
    as some converters write)."""
    import gguf

    model_dir, out = Path(model_dir), Path(out)
    arch = read_model_arch(model_dir)
    name = _FAMILY_ARCH[arch.family]
    writer = gguf.GGUFWriter(str(out), name)
    writer.add_name(model_dir.name)
    writer.add_context_length(arch.max_position_embeddings)
    writer.add_embedding_length(arch.hidden_size)
    writer.add_block_count(arch.num_layers)
    writer.add_feed_forward_length(arch.intermediate_size)
    writer.add_head_count(arch.num_heads)
    writer.add_head_count_kv(arch.num_kv_heads)
    writer.add_key_length(arch.head_dim)
    writer.add_value_length(arch.head_dim)
    writer.add_rope_dimension_count(arch.head_dim)
    writer.add_rope_freq_base(arch.rope.theta)
    writer.add_layer_norm_rms_eps(arch.rms_norm_eps)
    writer.add_vocab_size(arch.vocab_size)
    if arch.rope.rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(arch.rope.factor)
    num_experts = getattr(arch, "num_experts", 0)
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(arch.top_k)
        if name != "llama":  # Mixtral's experts are intermediate_size wide
            writer.add_expert_feed_forward_length(arch.moe_intermediate_size)
        if arch.shared_expert_intermediate_size:
            writer.add_expert_shared_feed_forward_length(arch.shared_expert_intermediate_size)
    if tokenizer:
        _tokenizer_fields(writer, model_dir, arch)
    if arch.rope.rope_type == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(arch))
    for hf, tensor in _hf_tensors(model_dir, arch, num_experts):
        if arch.tie_word_embeddings and hf == "lm_head.weight":
            continue
        if name == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            tensor = permute_rotary(tensor, arch.num_heads if ".q_proj." in hf else arch.num_kv_heads)
        if hf.endswith(".shared_expert_gate.weight"):  # one row, stored flat as llama.cpp stores it
            tensor = tensor.reshape(-1)
        kind = (tensor_type(hf) if callable(tensor_type) else tensor_type) if tensor.dim() >= 2 else "F32"
        data = quantize(tensor.numpy(), kind)
        raw = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(gguf_tensor_name(hf), data, raw_dtype=raw)  # the shape follows from the bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
