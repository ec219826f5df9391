"""The architecture facts the engine needs, read from a Hugging Face config.json.

`ModelArch` is the engine's view of any family (model/interface.py); each family's file parses
its own config.json into it (model/registry.py finds the family). Shared here: the rope
parameters in both the transformers 4.x spelling (`rope_theta`, `rope_scaling`) and the 5.x one
(`rope_parameters`), and the end-of-sequence ids.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

SLIDING = "sliding_attention"
FULL = "full_attention"


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
    hidden_act: str = "silu"  # the gated MLP's activation: silu | gelu_pytorch_tanh
    # each layer's attention kind (SLIDING: windowed by sliding_window); () = every layer SLIDING
    # when sliding_window is set, else FULL
    layer_types: tuple[str, ...] = ()
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim's)
    rope_local: RopeConfig | None = None  # the sliding layers' rotary embedding, where it differs
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def local(self, world_size: int, expert_parallel: bool = False) -> ModelArch:
        """The share one of `world_size` tensor-parallel ranks holds: its heads and its slice of
        the MLP (model/interface.py `local_arch`; a MoE arch splits its experts too)."""
        return dataclasses.replace(
            self,
            num_heads=self.num_heads // world_size,
            num_kv_heads=self.num_kv_heads // world_size,
            intermediate_size=self.intermediate_size // world_size,
        )

    def tp_split_sizes(self, expert_parallel: bool = False) -> dict[str, int]:
        """The config's sizes tensor parallelism divides by the rank count (named as config.json does)."""
        return {
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
        }

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`'s attention (None: full attention)."""
        if self.sliding_window is None:
            return None
        kind = self.layer_types[layer] if self.layer_types else SLIDING
        return self.sliding_window if kind == SLIDING else None


def read_model_arch(model_dir: Path) -> ModelArch:
    cfg = json.loads((model_dir / "config.json").read_text())
    return parse_model_arch(cfg)


def parse_model_arch(cfg: dict) -> ModelArch:
    """A config.json parsed by the family that serves it (UnsupportedModelError: none does)."""
    from llmserve.model.registry import parse_config

    return parse_config(cfg)


def eos_token_ids(cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())


def parse_rope(cfg: dict, params: dict | None = None) -> RopeConfig:
    """The rotary embedding of a config.json (`params`: a per-layer-type `rope_parameters` entry)."""
    params = dict(cfg.get("rope_parameters") or {}) if params is None else dict(params)
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
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )
