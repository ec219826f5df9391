"""A GGUF file's tensors under their Hugging Face names, dequantized to float32.

llama.cpp renames every tensor (`blk.3.attn_q.weight` is `model.layers.3.self_attn.q_proj.weight`)
and, for the `llama` architecture only, reorders the rows of q and k within each head
(its rotary embedding pairs neighbouring values, Hugging Face's pairs the two halves):
undone here so the model runs the Hugging Face way.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from tqdm import tqdm

from llmserve.model.arch import ModelArch
from llmserve.model.gguf.checkpoint import GGUFCheckpoint, GGUFError
from llmserve.model.gguf.dequant import dequantize

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_CONSUMED = frozenset({"rope_freqs.weight"})  # read into ModelArch (gguf/config.py)


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None: not a weight of the model)."""
    if name in _CONSUMED:
        return None
    if name in _GLOBAL:
        return _GLOBAL[name]
    match = _BLOCK_NAME.fullmatch(name)
    if match and match.group(2) in _LAYER:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER[part]}.{kind}"
    raise GGUFError(f"GGUF tensor {name!r} has no place in a Llama-family model")


def unpermute_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of q/k rows: within each head it interleaves the two
    halves (row i of the first half, then row i of the second)."""
    rows = w.shape[0]
    half = rows // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf_weights(ckpt: GGUFCheckpoint, arch: ModelArch, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every weight, in file order."""
    permuted = ckpt.architecture == "llama"
    tensors = list(ckpt.tensors.values())
    with tqdm(total=len(tensors), desc="Loading GGUF weights", unit="tensor", disable=not progress) as bar:
        for t in tensors:
            name = hf_name(t.name)
            bar.update(1)
            if name is None:
                continue
            weight = dequantize(t.data, t.type_name, t.shape)
            if permuted and (".q_proj." in name or ".k_proj." in name):
                weight = unpermute_rotary(weight, arch.num_heads if ".q_proj." in name else arch.num_kv_heads)
            yield name, weight
