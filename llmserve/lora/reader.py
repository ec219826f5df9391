"""Read a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) and check
it against the base model's shapes: an adapter that loads here fits the slots and the layers."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from llmserve.lora.adapter import LoRAAdapter, LoRAModuleWeights
from llmserve.lora.errors import LoRAAdapterError, LoRAErrorKind, unusable_path
from llmserve.lora.folder import AdapterFolder
from llmserve.lora.peft_config import PeftLoRAConfig, parse_peft_config
from llmserve.lora.projections import module_parent, module_shapes, supported_modules
from llmserve.model.interface import ModelArch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's saved names: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (an
# adapter name may follow lora_A in older saves)
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


def read_peft_adapter(path: str | Path, name: str, arch: ModelArch, max_rank: int,
                      dtype: torch.dtype = torch.float32, roots: Sequence[str] = ()) -> LoRAAdapter:  # fmt: skip
    """The adapter in folder `path`, its tensors in `dtype` on the CPU. Raises LoRAAdapterError
    (a ValueError: HTTP 400): one unusable-path error for a folder that cannot be opened or lacks
    either file (and, with `roots`, for anything outside them: folder.AdapterFolder); the reason
    for a bad config, a rank above `max_rank`, a module other than q/k/v/o/gate/up/down_proj,
    shapes that do not fit `arch`, or a PEFT feature that is not implemented (DoRA, biases,
    modules_to_save ...). Both files are read through the one open folder."""
    with AdapterFolder(str(path), roots) as folder:
        config_fd, weights_fd = folder.open_file(CONFIG_FILE), folder.open_file(WEIGHTS_FILE)
        try:
            if config_fd is None or weights_fd is None:
                raise unusable_path(_missing(folder, config_fd is None))
            config = parse_peft_config(_parse_json(folder.read_bytes(config_fd)), max_rank, supported_modules(arch))
            tensors = _read_tensors(folder.fd_path(weights_fd))
        finally:
            for fd in (config_fd, weights_fd):
                if fd is not None:
                    os.close(fd)
    modules = _pair_modules(tensors, config, arch)
    return LoRAAdapter(name, str(path), config.rank, config.scaling,
                       {key: LoRAModuleWeights(w.a.to(dtype), w.b.to(dtype)) for key, w in modules.items()})  # fmt: skip


def _missing(folder: AdapterFolder, config_missing: bool) -> str:
    """Why a folder is no adapter, for the server's log."""
    if config_missing:
        return f"{CONFIG_FILE} is missing in {folder.path!r}"
    if folder.has("adapter_model.bin"):
        return f"{folder.path!r} holds adapter_model.bin: only {WEIGHTS_FILE} is read"
    return f"{WEIGHTS_FILE} is missing in {folder.path!r}"


def _parse_json(data: bytes) -> object:
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoRAAdapterError(LoRAErrorKind.INVALID_CONFIG, f"{CONFIG_FILE} is not valid JSON: {e}") from None


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    try:
        with safe_open(path, framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise LoRAAdapterError(LoRAErrorKind.INVALID_WEIGHTS, f"{WEIGHTS_FILE} cannot be read: {e}") from None


def _pair_modules(tensors: dict[str, torch.Tensor], config: PeftLoRAConfig,
                  arch: ModelArch) -> dict[tuple[int, str], LoRAModuleWeights]:  # fmt: skip
    """(layer, module) -> A and B, every tensor named, paired and of the base model's shape."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer, module, half = _parse_key(key, arch)
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise LoRAAdapterError(LoRAErrorKind.INVALID_WEIGHTS, f"{WEIGHTS_FILE} holds no LoRA weights")
    if config.target_modules is not None:
        extra = sorted({m for _, m in halves} - set(config.target_modules))
        if extra:
            raise LoRAAdapterError(LoRAErrorKind.INVALID_WEIGHTS,
                                   f"weights for {extra}, which target_modules does not list")  # fmt: skip
    shapes = module_shapes(arch)
    modules = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(LoRAErrorKind.INVALID_WEIGHTS, f"layer {layer} {module}: lora_A and lora_B must "
                                   f"both be present, found only lora_{''.join(pair)}")  # fmt: skip
        in_features, out_features = shapes[module]
        _check_shape(pair["A"], (config.rank, in_features), layer, module, "lora_A")
        _check_shape(pair["B"], (out_features, config.rank), layer, module, "lora_B")
        modules[(layer, module)] = LoRAModuleWeights(pair["A"], pair["B"])
    return modules


def _parse_key(key: str, arch: ModelArch) -> tuple[int, str, str]:
    match = _KEY.match(key)
    if match is None:
        if "lora_magnitude_vector" in key:
            raise LoRAAdapterError(LoRAErrorKind.UNSUPPORTED_FEATURE, f"DoRA weights ({key}) are not supported")
        raise LoRAAdapterError(LoRAErrorKind.UNSUPPORTED_MODULE,
                               f"tensor {key!r} is not the LoRA A/B of a decoder layer's "
                               f"{', '.join(supported_modules(arch))}")  # fmt: skip
    layer, parent, module, half = int(match[1]), match[2], match[3], match[4]
    supported = supported_modules(arch)
    if module not in supported or parent != module_parent(arch, module):
        raise LoRAAdapterError(LoRAErrorKind.UNSUPPORTED_MODULE, f"tensor {key!r}: {parent}.{module} is not supported; "
                               f"supported: {', '.join(supported)}")  # fmt: skip
    if layer >= arch.num_layers:
        raise LoRAAdapterError(LoRAErrorKind.SHAPE_MISMATCH,
                               f"tensor {key!r} is for layer {layer}; the base model has {arch.num_layers} layers")  # fmt: skip
    return layer, module, half


def _check_shape(tensor: torch.Tensor, expected: tuple[int, int], layer: int, module: str, half: str) -> None:
    rank_dim = 0 if half == "lora_A" else 1
    if tensor.dim() == 2 and tensor.shape[rank_dim] != expected[rank_dim]:
        raise LoRAAdapterError(LoRAErrorKind.INVALID_WEIGHTS, f"layer {layer} {module}.{half} is "
                               f"{list(tensor.shape)}: rank {tensor.shape[rank_dim]}, but r is {expected[rank_dim]}")  # fmt: skip
    if tuple(tensor.shape) != expected:
        raise LoRAAdapterError(LoRAErrorKind.SHAPE_MISMATCH,
                               f"layer {layer} {module}.{half} is {list(tensor.shape)}, the base model needs "
                               f"{list(expected)}")  # fmt: skip
