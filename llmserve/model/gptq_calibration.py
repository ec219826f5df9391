"""GPTQ over a whole model: calibration text in, every projection's FP8 weight out.

`fp8_gptq.gptq_fp8` rounds one weight against the Hessian of its inputs. This module gives it
those inputs, as the GPTQ paper does, layer by layer ("sequential"): the calibration windows'
hidden states are kept between layers; layer i runs on them with hooks that sum its
projections' input Hessians X^T X (within a layer all its projections see the unrounded
layer's own inputs), GPTQ rounds the layer's weights, and the layer runs again with them to
give layer i + 1 its inputs, so each layer compensates the error of the layers before it.

The model is llmserve's own (`LlamaForCausalLM` with the reference attention, unquantized,
as `bench.accuracy.load_for_reading` loads it), so the names are its fused projections
(`model.layers.N.self_attn.qkv_proj`, ...). One scale per output row (row absmax / 448, the
grid `--quantization fp8` and per-channel FP8 checkpoints use); rows are rounded
independently, so a fused projection's rows are those of its parts, each rounded as it would
be alone. `make-fp8-checkpoint --gptq` writes the result; scripts/studies/fp8_gptq.py
measures it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path

import torch

from llmserve.model.attention import AttentionMetadata
from llmserve.model.fp8 import projection_paths
from llmserve.model.fp8_gptq import dequantize, gptq_fp8, input_hessian

BLOCK = 16  # cache block size of the calibration windows (any size gives the same result)


@dataclass(frozen=True, slots=True)
class GptqOptions:
    damp: float = 0.01  # fraction of H's mean diagonal added to its diagonal
    block: int = 128  # columns per lazy batch update
    act_order: bool = False  # columns by decreasing H[i, i]


@dataclass(frozen=True, slots=True)
class LayerReport:
    """What one layer's rounding did, for progress lines and studies."""

    layer: int
    hessians: dict[str, torch.Tensor]  # projection name -> X^T X (float64) of its inputs
    seconds: float
    mean_abs: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> mean |x| per input channel (AWQ)


def calibration_windows(token_ids: list[list[int]], window: int, tokens: int, mix: bool = True) -> list[list[int]]:
    """Windows of `window` ids, each text cut from its start, until `tokens` ids: round robin,
    one from each text in turn, so every text contributes whatever their lengths (`mix`), or
    the first text's windows first."""
    if window < 2 or tokens < window:
        raise ValueError(f"calibration needs windows of at least 2 tokens and at least one window "
                         f"(window {window}, tokens {tokens})")  # fmt: skip
    per_text = [[ids[s : s + window] for s in range(0, len(ids) - window + 1, window)] for ids in token_ids]
    if mix:
        ordered = [w for round_ in zip_longest(*per_text) for w in round_ if w is not None]
    else:
        ordered = [w for windows in per_text for w in windows]
    if not ordered:
        raise ValueError(f"no calibration text is {window} tokens long")
    return ordered[: tokens // window]


def read_calibration_texts(paths: list[str], tokenizer) -> list[list[int]]:
    """Each UTF-8 file's token ids (no special tokens), with a clear error for a missing one."""
    out = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"calibration text {path!r} is not a file")
        out.append(tokenizer.encode(p.read_text(encoding="utf-8"), add_special_tokens=False, verbose=False))
    return out


def window_metadata(n: int, device: torch.device) -> AttentionMetadata:
    """One sequence of n new tokens in cache slots 0..n-1 (one window from an empty cache)."""
    blocks = -(-n // BLOCK)
    return AttentionMetadata(
        slot_mapping=torch.arange(n, device=device), query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None], max_query_len=n, max_seq_len=n,
    )  # fmt: skip


def projections(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's projections by name (what `--quantization fp8` quantizes)."""
    paths = projection_paths(model.arch)
    return {n: m for n, m in model.named_modules() if n.endswith(paths)}


def gptq_model(
    model: torch.nn.Module, windows: list[list[int]], skip: set[str] = frozenset(), options: GptqOptions = GptqOptions(),
    input_transform: Callable[[torch.Tensor], torch.Tensor] | None = None, sequential: bool = True,
    on_layer: Callable[[LayerReport, dict[str, tuple[torch.Tensor, torch.Tensor]]], None] | None = None,
    round_weight: Callable[[torch.Tensor, torch.Tensor], tuple[object, torch.Tensor]] | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """(FP8 weight, float32 scale [rows, 1]) for every projection of `model` not in `skip`,
    rounded by GPTQ on the calibration `windows` (token-id lists), layer by layer. The model's
    weights are left as they were. `input_transform`: applied to each projection's input, in
    the Hessians and the runs (a study's fake activation quantization); `sequential` False:
    every layer's inputs come from the unrounded model. `on_layer`: called after each layer
    with what it did and its results. `round_weight` (weight, Hessian) -> (result, the rounded
    weight in float): another grid than FP8's (model/w4a16_gptq.py's 4-bit groups); the results
    are then its own."""
    mods = projections(model)
    original = {n: m.weight.detach().clone() for n, m in mods.items()}
    layers = model.model.layers
    attention = model.attention_layers()
    arch = model.shard
    device = next(model.parameters()).device
    cache_dtype = next(model.parameters()).dtype
    metas = [window_metadata(len(ids), device) for ids in windows]
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.inference_mode():
        # the model's own embedding step (Gemma 3 scales the rows by sqrt(hidden_size))
        states = [(model.model.embed(torch.tensor(ids, device=device)), None) for ids in windows]

    def run_layer(i: int, hooks_for: list[str], collect: dict[str, torch.Tensor] | None,
                  abs_sums: dict[str, list] | None = None) -> list:  # fmt: skip
        def hook(name):
            def pre(_m, args):
                x = input_transform(args[0]) if input_transform is not None else args[0]
                if collect is not None:
                    collect[name] += input_hessian(x).to(collect[name].device)
                if abs_sums is not None:  # [sum of |x| per channel (float64), rows]
                    rows = x.reshape(-1, x.shape[-1])
                    abs_sums[name][0] += rows.abs().sum(0, dtype=torch.float64)
                    abs_sums[name][1] += rows.shape[0]
                return (x,)

            return pre

        handles = [mods[n].register_forward_pre_hook(hook(n)) for n in hooks_for]
        try:
            result = []
            with torch.inference_mode():
                for (x, residual), meta, ids in zip(states, metas, windows):
                    n = len(ids)
                    attention[i].kv_cache = torch.zeros(2, -(-n // BLOCK), BLOCK, arch.num_kv_heads, arch.head_dim,
                                                        dtype=cache_dtype, device=device)  # fmt: skip
                    result.append(layers[i](torch.arange(n, device=device), x, residual, meta))
            return result
        finally:
            for h in handles:
                h.remove()
            attention[i].kv_cache = torch.empty(0)  # unbound again

    try:
        for i in range(len(layers)):
            started = time.perf_counter()
            names = [n for n in mods if n.startswith(f"model.layers.{i}.") and n not in skip]
            hessians = {n: torch.zeros(mods[n].weight.shape[1], mods[n].weight.shape[1], dtype=torch.float64, device=device)
                        for n in names}  # fmt: skip
            abs_sums = {n: [torch.zeros(mods[n].weight.shape[1], dtype=torch.float64, device=device), 0] for n in names}
            unrounded = run_layer(i, names, hessians, abs_sums)
            done = {}
            with torch.no_grad():
                for n in names:
                    if round_weight is not None:
                        done[n], rounded = round_weight(original[n], hessians[n])
                        mods[n].weight.copy_(rounded.to(original[n].dtype))
                        continue
                    q, scale = gptq_fp8(original[n], hessians[n], options.damp, options.block, options.act_order)
                    done[n] = (q, scale)
                    mods[n].weight.copy_(dequantize(q, scale, original[n].dtype))
            states = run_layer(i, names if input_transform is not None else [], None) if sequential else unrounded
            out.update(done)
            if on_layer is not None:
                mean_abs = {n: total / max(rows, 1) for n, (total, rows) in abs_sums.items()}
                on_layer(LayerReport(i, hessians, time.perf_counter() - started, mean_abs), done)
    finally:
        with torch.no_grad():
            for n, m in mods.items():
                m.weight.copy_(original[n])
    return out
