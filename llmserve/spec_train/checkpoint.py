"""A trained head written as published EAGLE-3 heads are (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's
layout, which vLLM, SGLang and model/eagle_format.py read): config.json (a one-layer Llama config
with `architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size` and
`eagle_config.eagle_aux_hidden_state_layer_ids`) and model.safetensors (`fc`, `midlayer.*`,
`norm`, `lm_head`, `d2t`, `t2d`; no embedding: the target's is used)."""

from __future__ import annotations

import json
from pathlib import Path

from llmserve.model.arch import ModelArch
from llmserve.model.eagle3_train_head import Eagle3TrainHead
from llmserve.spec_train.vocab import DraftVocab


def head_config(target: ModelArch, aux_layers: tuple[int, ...], draft_vocab_size: int) -> dict:
    """The head's config.json: the target's attention and MLP shape, one layer, plain Llama
    (no biases, no q/k norms: EAGLE-3 heads are Llama layers whatever the target's family)."""
    rope = target.rope
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": target.rms_norm_eps,
        "max_position_embeddings": target.max_position_embeddings,
        "rope_theta": rope.theta,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": target.bos_token_id,
        "eos_token_id": list(target.eos_token_ids),
        "torch_dtype": "float32",
        "norm_before_residual": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers)},
    }
    if (
        rope.rope_type != "default"
    ):  # (a GGUF's per-frequency factors have no config spelling: the head's own rope is plain)
        cfg["rope_scaling"] = {"rope_type": rope.rope_type, "factor": rope.factor,
                               "low_freq_factor": rope.low_freq_factor, "high_freq_factor": rope.high_freq_factor,
                               "original_max_position_embeddings": rope.original_max_position_embeddings}  # fmt: skip
    return cfg


def head_arch(cfg: dict) -> ModelArch:
    """The decoder shape the runtime builds from the config (model/eagle_format.py reads it so)."""
    from llmserve.model.llama import parse_config

    return parse_config({**cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})


def write_head(out: Path, cfg: dict, head: Eagle3TrainHead, vocab: DraftVocab, training: dict) -> Path:
    """config.json, model.safetensors, and training.json (how it was trained; read by nothing)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {**head.published_tensors(), "d2t": vocab.d2t(), "t2d": vocab.t2d()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(training, indent=2) + "\n")
    return out
