"""The model families llmserve runs, found by a checkpoint's names.

A family is a module of `llmserve.model` with a `FAMILY` (model/interface.py `ModelFamily`);
this list is the one place that names them. Lookups: by Hugging Face `architectures` (or
`model_type`), by GGUF `general.architecture`, and by a parsed `ModelArch`.
"""

from __future__ import annotations

import importlib
from functools import cache

from llmserve.model.arch import ModelArch, UnsupportedModelError
from llmserve.model.interface import ModelFamily

FAMILY_MODULES = (
    "llmserve.model.llama",  # Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3
    "llmserve.model.gemma3",  # Gemma 3 (text)
    "llmserve.model.qwen3_moe",  # Qwen3-MoE
    "llmserve.model.qwen2_moe",  # Qwen2-MoE (shared expert)
    "llmserve.model.mixtral",  # Mixtral
)


@cache
def families() -> tuple[ModelFamily, ...]:
    return tuple(importlib.import_module(name).FAMILY for name in FAMILY_MODULES)


def supported_architectures() -> list[str]:
    return [a for family in families() for a in family.architectures]


def family_for_config(cfg: dict) -> ModelFamily:
    """The family of a Hugging Face config.json: by its `architectures`, else its `model_type`."""
    architectures = cfg.get("architectures") or []
    for name in architectures:
        for family in families():
            if name in family.architectures:
                return family
    model_type = cfg.get("model_type", "")
    for family in families():
        if model_type in family.model_types:
            return family
    raise UnsupportedModelError(f"unsupported architecture {architectures or model_type!r}; "
                                f"supported: {', '.join(supported_architectures())}")  # fmt: skip


def family_for_gguf(gguf_architecture: str) -> ModelFamily | None:
    return next((f for f in families() if gguf_architecture in f.gguf_architectures), None)


def gguf_architectures() -> list[str]:
    return [a for family in families() for a in family.gguf_architectures]


def family_of(arch: ModelArch) -> ModelFamily:
    for family in families():
        if arch.architecture in family.architectures:
            return family
    raise UnsupportedModelError(f"no model family serves {arch.architecture!r}")


def parse_config(cfg: dict) -> ModelArch:
    return family_for_config(cfg).parse_config(cfg)
