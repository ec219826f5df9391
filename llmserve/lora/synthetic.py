"""Random LoRA adapters in PEFT's file format, for a base model's shape: what `llmserve bench`
serves when it measures many adapters (no adapter files need to exist, as with dummy weights).

Each adapter targets all seven projections of every layer, with A ~ N(0, 1/in) and B ~
N(0, 0.02) so its outputs stay small next to the base model's, as trained adapters' do.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from llmserve.lora.projections import module_parent, module_shapes, supported_modules
from llmserve.lora.reader import CONFIG_FILE, WEIGHTS_FILE
from llmserve.model.interface import ModelArch


def write_random_adapter(arch: ModelArch, folder: str | Path, rank: int, seed: int,
                         alpha: float | None = None, dtype: torch.dtype = torch.bfloat16) -> Path:  # fmt: skip
    """Write a rank-`rank` adapter for `arch` into `folder` (made if missing); returns it."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shapes = module_shapes(arch)
    tensors = {}
    for layer in range(arch.num_layers):
        for module in supported_modules(arch):
            in_features, out_features = shapes[module]
            key = f"base_model.model.model.layers.{layer}.{module_parent(arch, module)}.{module}"
            a = torch.randn(rank, in_features, generator=gen) / in_features**0.5
            b = torch.randn(out_features, rank, generator=gen) * 0.02
            tensors[f"{key}.lora_A.weight"] = a.to(dtype).contiguous()
            tensors[f"{key}.lora_B.weight"] = b.to(dtype).contiguous()
    save_file(tensors, str(out / WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": float(alpha if alpha is not None else 2 * rank),
              "target_modules": list(supported_modules(arch)), "bias": "none", "task_type": "CAUSAL_LM"}  # fmt: skip
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return out


def write_random_adapters(arch: ModelArch, root: str | Path, count: int, rank: int, seed: int = 0) -> list[Path]:
    """`count` adapters under `root` (adapter-0, adapter-1, ...), each with its own seed."""
    return [write_random_adapter(arch, Path(root) / f"adapter-{i}", rank, seed + i) for i in range(count)]
