"""Write a model's first N decoder layers, with its embeddings, final norm and LM head, as a
Hugging Face folder (float32 safetensors, config.json, the tokenizer): a draft model for
speculative decoding that shares the target's tokenizer and needs no training (docs/spec_decode.md).

    python scripts/truncate_model.py SmolLM2-135M-Instruct /tmp/smollm2-8l --layers 8

The source is a Hugging Face folder, a GGUF file (dequantized), or the default model's name.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from llmserve.config import resolve_model_path
from llmserve.tokenizer import load_tokenizer

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def source_config(src: Path) -> dict:
    if src.is_file():
        from llmserve.model.gguf.checkpoint import open_gguf
        from llmserve.model.gguf.config import gguf_hf_config

        return gguf_hf_config(open_gguf(src))
    return json.loads((src / "config.json").read_text())


def source_tensors(src: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of every weight."""
    if src.is_file():
        from llmserve.config import read_arch
        from llmserve.model.gguf.checkpoint import open_gguf
        from llmserve.model.gguf.weights import iter_gguf_weights

        yield from iter_gguf_weights(open_gguf(src), read_arch(src), progress=False)
        return
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def truncate(src: Path, out: Path, layers: int) -> None:
    config = source_config(src)
    total = config["num_hidden_layers"]
    if not 1 <= layers <= total:
        raise SystemExit(f"--layers must be in [1, {total}]")
    config["num_hidden_layers"] = layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:layers]
    kept = {}
    for name, tensor in source_tensors(src):
        match = _LAYER.match(name)
        if match is None or int(match.group(1)) < layers:
            kept[name] = tensor.to(torch.float32).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    load_tokenizer(str(src)).save_pretrained(str(out))
    print(f"{out}: {layers} of {total} layers, {sum(t.numel() for t in kept.values()) / 1e6:.1f} M parameters")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a Hugging Face folder, a GGUF file, or the default model's name")
    parser.add_argument("out", help="the folder to write")
    parser.add_argument("--layers", type=int, required=True, help="how many of the first decoder layers to keep")
    args = parser.parse_args()
    truncate(resolve_model_path(args.model), Path(args.out), args.layers)


if __name__ == "__main__":
    main()
