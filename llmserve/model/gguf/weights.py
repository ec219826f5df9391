"""A GGUF file's tensors under their Hugging Face names, dequantized to float32.

llama.cpp renames every tensor (`blk.3.attn_q.weight` is `model.layers.3.self_attn.q_proj.weight`)
and stores some differently (the `llama` architecture's q/k rows reordered, Gemma's norms plus
one): the family (model/registry.py) maps the names and undoes the changes, so the model runs
the Hugging Face way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from tqdm import tqdm

from llmserve.model.arch import ModelArch, UnsupportedModelError
from llmserve.model.gguf.checkpoint import GGUFCheckpoint, GGUFError, GGUFTensor
from llmserve.model.gguf.dequant import dequantize
from llmserve.model.registry import family_for_gguf


def hf_name(name: str, gguf_architecture: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None: not a weight of the model), by its family."""
    family = family_for_gguf(gguf_architecture)
    if family is None:
        raise GGUFError(f"GGUF architecture {gguf_architecture!r} is not supported")
    try:
        return family.gguf_tensor_name(name)
    except UnsupportedModelError as exc:
        raise GGUFError(str(exc)) from None


def unpermute_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of q/k rows: within each head it interleaves the two
    halves (row i of the first half, then row i of the second)."""
    rows = w.shape[0]
    half = rows // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf_weights(
    ckpt: GGUFCheckpoint, arch: ModelArch, progress: bool = True, take: Callable[[str, GGUFTensor], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every weight, in file order; a tensor `take`
    takes (returns True for: model/gguf_keep.py keeps its blocks) is not dequantized."""
    family = family_for_gguf(ckpt.architecture)
    tensors = list(ckpt.tensors.values())
    with tqdm(total=len(tensors), desc="Loading GGUF weights", unit="tensor", disable=not progress) as bar:
        for t in tensors:
            name = hf_name(t.name, ckpt.architecture)
            bar.update(1)
            if name is None or (take is not None and take(name, t)):
                continue
            weight = dequantize(t.data, t.type_name, t.shape)
            yield name, family.gguf_tensor_values(name, weight, arch, ckpt.architecture)
