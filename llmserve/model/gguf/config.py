"""A GGUF file's metadata as the Hugging Face config the engine reads (`ModelArch`).

llama.cpp names the architecture (`general.architecture`) and keeps its numbers under that
name (`llama.block_count`, `qwen2.attention.head_count_kv`, ...). The numbers every family has
are read here; the family registered for the architecture (model/registry.py) adds its own
(`ModelFamily.gguf_config`) and names the Hugging Face architecture. Mistral's GGUFs say `llama`.
"""

from __future__ import annotations

import dataclasses

from llmserve.model.arch import ModelArch, parse_model_arch
from llmserve.model.gguf.checkpoint import GGUFCheckpoint, GGUFError
from llmserve.model.registry import family_for_gguf, gguf_architectures


def gguf_hf_config(ckpt: GGUFCheckpoint) -> dict:
    """The Hugging Face config.json a GGUF's metadata describes."""
    arch = ckpt.architecture
    family = family_for_gguf(arch)
    if family is None:
        raise GGUFError(f"{str(ckpt.path)!r}: GGUF architecture {arch!r} is not supported "
                        f"(supported: {', '.join(gguf_architectures())})")  # fmt: skip
    missing = [k for k in ("embedding_length", "block_count", "feed_forward_length", "attention.head_count")
               if ckpt.arch_key(k) is None]  # fmt: skip
    if missing:
        raise GGUFError(f"{str(ckpt.path)!r}: the metadata lacks {', '.join(f'{arch}.{k}' for k in missing)}")
    hidden = int(ckpt.arch_key("embedding_length"))
    heads = int(ckpt.arch_key("attention.head_count"))
    head_dim = int(ckpt.arch_key("attention.key_length", hidden // heads))
    rope_dims = int(ckpt.arch_key("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise GGUFError(f"{str(ckpt.path)!r}: rotary embedding on {rope_dims} of {head_dim} head dimensions "
                        "(partial rotary) is not supported")  # fmt: skip
    embed = ckpt.tensors.get("token_embd.weight")
    if embed is None:
        raise GGUFError(f"{str(ckpt.path)!r} has no token_embd.weight tensor")
    meta = ckpt.metadata
    config = {
        "model_type": arch,
        "vocab_size": embed.shape[0],
        "hidden_size": hidden,
        "intermediate_size": int(ckpt.arch_key("feed_forward_length")),
        "num_hidden_layers": int(ckpt.arch_key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(ckpt.arch_key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(ckpt.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(ckpt.arch_key("context_length", 2048)),
        "rope_theta": float(ckpt.arch_key("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in ckpt.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": end_token_ids(ckpt),
    }
    scaling = ckpt.arch_key("rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(ckpt.arch_key("rope.scaling.factor", 1.0))}
    elif scaling not in (None, "none"):
        raise GGUFError(f"{str(ckpt.path)!r}: rope scaling {scaling!r} is not supported (none and linear are)")
    return family.gguf_config(ckpt, config)


def check_gguf_tokenizer(ckpt: GGUFCheckpoint) -> None:
    """A GGUF used as its own tokenizer must carry one (llama.cpp writes it; some tools do not)."""
    if not ckpt.metadata.get("tokenizer.ggml.model") or not ckpt.vocab_size:
        raise GGUFError(f"{str(ckpt.path)!r} holds no tokenizer (no tokenizer.ggml.* metadata): "
                        "pass --tokenizer with a Hugging Face folder or another GGUF file")  # fmt: skip


def end_token_ids(ckpt: GGUFCheckpoint) -> list[int]:
    """The tokens that end a reply: end of sequence, end of turn, end of message."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return sorted({int(ckpt.metadata[k]) for k in keys if ckpt.metadata.get(k) is not None})


def gguf_model_arch(ckpt: GGUFCheckpoint) -> ModelArch:
    """The engine's view of the model; Llama 3.1's `rope_freqs` tensor (its rope scaling,
    as llama.cpp stores it) becomes per-frequency divisors."""
    arch = parse_model_arch(gguf_hf_config(ckpt))
    freqs = ckpt.tensors.get("rope_freqs.weight")
    if freqs is None:
        return arch
    from llmserve.model.gguf.dequant import dequantize

    factors = tuple(float(x) for x in dequantize(freqs.data, freqs.type_name, freqs.shape).tolist())
    if len(factors) != arch.head_dim // 2:
        raise GGUFError(f"{str(ckpt.path)!r}: rope_freqs holds {len(factors)} values, not {arch.head_dim // 2}")
    return dataclasses.replace(arch, rope=dataclasses.replace(arch.rope, freq_factors=factors))
