"""The architecture facts the engine needs, read from a Hugging Face config.json.

Reads both the transformers 4.x spelling (`rope_theta`, `rope_scaling`) and the 5.x one
(`rope_parameters`), so folders saved by either load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# architecture name -> family flags; all are the Llama block with small variations
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class UnsupportedModelError(ValueError):
    """The folder holds a model this engine cannot run."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] | None = None  # each frequency divided by its factor (GGUF's rope_freqs)


@dataclass(frozen=True, slots=True)
class ModelArch:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2)
    o_proj_bias: bool  # bias on the attention output projection (Llama/Qwen3 with attention_bias)
    qk_norm: bool  # RMSNorm on each head of q and k before rotary (Qwen3)
    mlp_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def read_model_arch(model_dir: Path) -> ModelArch:
    cfg = json.loads((model_dir / "config.json").read_text())
    return parse_model_arch(cfg)


def parse_model_arch(cfg: dict) -> ModelArch:
    architectures = cfg.get("architectures") or []
    arch_name = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch_name is None:
        by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
        arch_name = by_type.get(cfg.get("model_type", ""))
    if arch_name is None:
        raise UnsupportedModelError(
            f"unsupported architecture {architectures or cfg.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"unsupported hidden_act {cfg.get('hidden_act')!r}")
    family = SUPPORTED_ARCHITECTURES[arch_name]
    num_heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return ModelArch(
        architecture=arch_name,
        family=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rope=_parse_rope(cfg),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=(family == "qwen2") or bool(cfg.get("attention_bias", False)),
        o_proj_bias=family in ("llama", "qwen3") and bool(cfg.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        sliding_window=_sliding_window(cfg, family),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
    )


def _parse_rope(cfg: dict) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise UnsupportedModelError(f"unsupported rope type {rope_type!r}")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", 8192)
        ),
    )


def _sliding_window(cfg: dict, family: str) -> int | None:
    window = cfg.get("sliding_window")
    if family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        return None
    return int(window) if window else None
