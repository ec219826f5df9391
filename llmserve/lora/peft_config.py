"""adapter_config.json of a PEFT LoRA adapter, checked: what llmserve serves, and a clear
refusal for every option that would change the forward pass in a way it does not implement."""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmserve.lora.errors import LoRAAdapterError, LoRAErrorKind

# options that change nothing at inference (training, initialisation, bookkeeping)
_HARMLESS = frozenset({
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "r", "target_modules", "exclude_modules", "lora_alpha", "lora_dropout", "use_rslora",
    "init_lora_weights", "layers_to_transform", "layers_pattern", "megatron_config", "megatron_core",
    "loftq_config", "eva_config", "corda_config", "lora_ga_config", "runtime_config", "qalora_group_size",
    "ensure_weight_tying", "fan_in_fan_out", "bias",
})  # fmt: skip
# initialisations that also rewrite the base weights: the adapter is only right on that changed base
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "lora_ga")


@dataclass(frozen=True, slots=True)
class PeftLoRAConfig:
    """The fields of adapter_config.json that llmserve uses."""

    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | None  # None: PEFT's regex form; the weights say which modules
    base_model: str | None  # base_model_name_or_path, for messages (the shapes are what is checked)

    @property
    def scaling(self) -> float:
        """PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def parse_peft_config(data: object, max_rank: int, supported: tuple[str, ...]) -> PeftLoRAConfig:
    """The checked config of a LoRA adapter whose targets must be among `supported` (PEFT module
    names); raises LoRAAdapterError naming the first problem."""
    if not isinstance(data, dict):
        raise _invalid(f"adapter_config.json must hold a JSON object, not {type(data).__name__}")
    peft_type = data.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAAdapterError(
            LoRAErrorKind.UNSUPPORTED_FEATURE, f"peft_type {peft_type!r}: only LORA adapters are served"
        )
    _refuse_features(data)
    rank = data.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _invalid(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAAdapterError(LoRAErrorKind.RANK_TOO_LARGE, f"rank {rank} is above the maximum LoRA rank {max_rank}")
    alpha = data.get("lora_alpha", 8)  # PEFT's default
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise _invalid(f"lora_alpha must be a number, got {alpha!r}")
    return PeftLoRAConfig(rank, float(alpha), bool(data.get("use_rslora", False)), _targets(data.get("target_modules"), supported),
                          data.get("base_model_name_or_path"))  # fmt: skip


def _refuse_features(data: dict) -> None:
    if data.get("use_dora"):
        raise _unsupported("DoRA (use_dora) is not supported")
    if data.get("bias", "none") != "none":
        raise _unsupported(f"bias {data['bias']!r}: only adapters without biases (bias 'none') are supported")
    if data.get("modules_to_save"):
        raise _unsupported(f"modules_to_save {data['modules_to_save']!r}: fully trained modules are not supported")
    if data.get("fan_in_fan_out"):
        raise _unsupported("fan_in_fan_out (Conv1D layers) is not supported")
    init = data.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise _unsupported(f"init_lora_weights {init!r} changed the base weights; convert the adapter to a plain "
                           "LoRA (PEFT's path_initial_model_for_weight_conversion) first")  # fmt: skip
    for key in sorted(set(data) - _HARMLESS):
        if data[key] not in (None, False, "", [], {}):
            raise _unsupported(f"{key} = {data[key]!r} is not supported (it changes the forward pass)")


def _targets(value: object, supported: tuple[str, ...]) -> tuple[str, ...] | None:
    if isinstance(value, str):  # a regex over module names: the saved weights tell which matched
        return None
    if not isinstance(value, list) or not all(isinstance(m, str) for m in value) or not value:
        raise _invalid(f"target_modules must be a list of module names or a regex, got {value!r}")
    unsupported = sorted({m.rsplit(".", 1)[-1] for m in value} - set(supported))
    if unsupported:
        raise LoRAAdapterError(LoRAErrorKind.UNSUPPORTED_MODULE, f"target modules {unsupported} are not supported; "
                               f"supported: {', '.join(supported)}")  # fmt: skip
    return tuple(sorted({m.rsplit(".", 1)[-1] for m in value}))


def _invalid(message: str) -> LoRAAdapterError:
    return LoRAAdapterError(LoRAErrorKind.INVALID_CONFIG, message)


def _unsupported(message: str) -> LoRAAdapterError:
    return LoRAAdapterError(LoRAErrorKind.UNSUPPORTED_FEATURE, message)
