"""Small Hugging Face model folders with random weights, built locally.

Tests and CPU benchmarks use these instead of hub downloads: the same folder loads in
transformers (the oracle) and in llmserve.
"""

from __future__ import annotations

import collections
import inspect
import json
import textwrap
from pathlib import Path

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")  # mixtures of experts (model/moe_block.py)
# family -> transformers' (config class, model class)
_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
            "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
            "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
            "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
            "mixtral": ("MixtralConfig", "MixtralForCausalLM")}  # fmt: skip
# the MoE families' small shape: 8 experts of 32, 2 a token (Qwen2-MoE's shared expert 64 wide)
_MOE_SHAPES = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
}  # fmt: skip
_MOE_ROUTER_SCALE, _MOE_EXPERT_SCALE = 25.0, 5.0

# a minimal chat template, so random models can serve /v1/chat/completions in tests
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
)


def _scale_experts(model: torch.nn.Module) -> None:
    """Routers and experts drawn larger than the 0.02 initialisation: decisive routing (no near
    ties) and expert outputs that outweigh the residual, so which experts run, and how their
    outputs are weighted, decide the tokens."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(_MOE_ROUTER_SCALE)
            elif ".mlp.experts." in name or ".mlp.shared_expert" in name:
                param.mul_(_MOE_EXPERT_SCALE)


def build_tokenizer(out_dir: Path, vocab_size: int = 512) -> None:
    """Train a small byte-level BPE tokenizer on standard-library docstrings."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [inspect.getdoc(m) or "" for m in (collections, json, textwrap, inspect, Path)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def make_random_model(
    out_dir: str | Path,
    family: str = "llama",
    seed: int = 0,
    vocab_size: int = 512,
    config_only: bool = False,
    **overrides,
) -> Path:
    """Write config.json, model.safetensors (float32) and a tokenizer to `out_dir`.

    With `config_only`, no weights: the folder serves `load_format="dummy"` (benchmarks of
    large shapes, whose random weights are made on the device)."""
    import transformers

    if family not in FAMILIES + MOE_FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES + MOE_FAMILIES}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config_cls, model_cls = (getattr(transformers, name) for name in _CLASSES[family])
    # Gemma 3: a small window and head, six layers (five slide, one is global): long prompts cross the window
    shape = {"head_dim": 16, "sliding_window": 16, "num_hidden_layers": 6, "query_pre_attn_scalar": 16,
             "pad_token_id": 0} if family == "gemma3" else _MOE_SHAPES.get(family, {})  # fmt: skip
    kwargs = {**_BASE, **shape, "vocab_size": vocab_size, **overrides}
    if family == "qwen3":
        kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
    if family == "mistral":
        kwargs.setdefault("sliding_window", None)
    config = config_cls(**kwargs)
    if config_only:
        config.architectures = [model_cls.__name__]
        config.save_pretrained(out)
        build_tokenizer(out, vocab_size=min(vocab_size, 512))
        return out
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    if family in MOE_FAMILIES:
        _scale_experts(model)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer(out, vocab_size=min(vocab_size, 512))
    gen = out / "generation_config.json"
    if gen.exists():
        data = json.loads(gen.read_text())
        data["eos_token_id"] = kwargs["eos_token_id"]
        gen.write_text(json.dumps(data))
    return out
