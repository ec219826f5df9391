"""GGUF files kept quantized: which projections keep their blocks, the layers built for them, and
their tensors loaded as blocks (model/gguf_linear.py) while every other tensor is dequantized.

Each tensor keeps its own format (a Q4_K_M file mixes Q4_K and Q6_K; the embedding, norms and LM
head are dequantized as before): a projection part in one of `KEPT_FORMATS` whose rows are whole
blocks keeps its blocks, any other part (Q4_1, F16, ...) is dequantized into dense rows of the
same layer, and a projection with no kept part stays the plain layer. What the family does to a
GGUF tensor's values must be a permutation of its rows (llama's q/k reorder; Gemma's norms plus
one touch no projection): checked by running it on the row numbers, and applied to the block
rows, which gives exactly the permuted dequantized rows.

Tensor parallelism: a column-parallel layer's rank takes its rows of each part (after the row
permutation, as the dequantized path slices the permuted rows); a row-parallel layer's rank takes
its share of every row's blocks, which must be whole blocks: a part whose per-rank inputs are not
(o_proj of 2,048 inputs over 16 ranks: 128 each, K-quant blocks of 256) is dequantized into dense
rows instead, each rank its columns, and the log line at load names them.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from llmserve.model.arch import ModelArch
from llmserve.model.gguf.checkpoint import GGUFCheckpoint, GGUFTensor
from llmserve.model.gguf.dequant import dequantize
from llmserve.model.gguf_linear import KEPT_FORMATS, DenseRows, GGUFBlocks, GGUFLinear, split_blocks
from llmserve.model.tensor_parallel import SINGLE, TPGroup, rank_slice

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PartPlace:
    """Where one checkpoint part's rows go: piece `piece` of module `module`, from row `offset`."""

    module: str  # the (fused) layer's name: model.layers.0.self_attn.qkv_proj
    piece: int
    offset: int


@dataclass(frozen=True, slots=True)
class KeepPlan:
    layers: dict[str, list[tuple[str, int]]]  # kept layer -> its pieces' (type name or "dense", rows) on one rank
    parts: dict[str, PartPlace]  # a kept layer's parts, by the checkpoint's weight name
    dequantized: dict[str, int]  # formats not kept -> projection tensors (logged)
    # row-parallel tensors of a kept format dequantized because a rank's inputs are not whole blocks (logged)
    split_in_blocks: dict[str, int] = field(default_factory=dict)
    world_size: int = 1
    row_parallel: frozenset[str] = frozenset()  # the kept layers whose inputs are split over the ranks


def _row_permutation(family, name: str, rows: int, arch: ModelArch, gguf_arch: str) -> torch.Tensor | None:
    """The rows the family's GGUF transform takes for `name`, or None when it does more than
    reorder rows (the tensor is then dequantized)."""
    probe = torch.arange(rows, dtype=torch.float64, device="cpu").reshape(rows, 1)  # (built under the meta device)
    out = family.gguf_tensor_values(name, probe, arch, gguf_arch)
    if out.shape != probe.shape or not torch.equal(out.reshape(-1).sort().values, probe.reshape(-1)):
        return None
    return out.reshape(-1).long()


def keep_plan(ckpt: GGUFCheckpoint, arch: ModelArch, world_size: int = 1) -> KeepPlan:
    """The layers of a GGUF file's model that keep their blocks (by their parts' formats), as each
    of `world_size` tensor-parallel ranks holds them."""
    from llmserve.model.gguf.weights import hf_name
    from llmserve.model.registry import family_for_gguf, family_of

    by_name = {hf_name(t.name, ckpt.architecture): t for t in ckpt.tensors.values()}
    gguf_family = family_for_gguf(ckpt.architecture)
    layers: dict[str, list[tuple[str, int]]] = {}
    parts: dict[str, PartPlace] = {}
    dequantized: Counter[str] = Counter()
    split: Counter[str] = Counter()
    row_parallel: set[str] = set()
    for spec in family_of(arch).linears(arch):
        row = spec.parallel == "row" and world_size > 1
        for i in range(arch.num_layers):
            if not spec.in_layer(i):
                continue
            module = f"model.layers.{i}.{spec.path}"
            kinds = []
            for part, width in zip(spec.parts, spec.widths):
                name = f"model.layers.{i}.{spec.parent}.{part}.weight"
                t = by_name.get(name)
                kept = (t is not None and t.type_name in KEPT_FORMATS and spec.in_features % KEPT_FORMATS[t.type_name].block == 0
                        and _row_permutation(gguf_family, name, width, arch, ckpt.architecture) is not None)  # fmt: skip
                if t is not None and not kept and t.type_name not in ("F32", "F16", "BF16"):
                    dequantized[t.type_name] += 1
                if kept and row and (spec.in_features // world_size) % KEPT_FORMATS[t.type_name].block:
                    kept = False  # a rank's share of a row would end inside a block
                    split[t.type_name] += 1
                # a column-parallel rank holds 1 / world_size of each part's rows (check_tp_shape)
                kinds.append((name, t.type_name if kept else "dense", width if row else width // world_size))
            if all(kind == "dense" for _, kind, _ in kinds):
                continue
            pieces: list[tuple[str, int]] = []
            for name, kind, width in kinds:  # adjacent parts of one format share a piece
                if pieces and pieces[-1][0] == kind:
                    pieces[-1] = (kind, pieces[-1][1] + width)
                    offset = pieces[-1][1] - width
                else:
                    pieces.append((kind, width))
                    offset = 0
                parts[name] = PartPlace(module, len(pieces) - 1, offset)
            layers[module] = pieces
            if row:
                row_parallel.add(module)
    return KeepPlan(layers, parts, dict(dequantized), dict(split), world_size, frozenset(row_parallel))


def keep_gguf_quantized(model: nn.Module, model_path: str | Path, arch: ModelArch, matmul, tp: TPGroup) -> KeepPlan:
    """Swap the projections of `model` (on the meta device, before memory is allocated) for GGUF
    layers, as the file's formats say; `matmul` is the layers' product (`LayerOps.gguf_matmul`)."""
    from llmserve.model.gguf.checkpoint import open_gguf

    plan = keep_plan(open_gguf(model_path), arch, tp.world_size)
    swapped: Counter[str] = Counter()
    for module, pieces in plan.layers.items():
        try:
            old = model.get_submodule(module)
        except AttributeError:  # a layer another pipeline stage holds
            continue
        parent, _, attr = module.rpartition(".")
        row_tp = tp if module in plan.row_parallel else None
        setattr(
            model.get_submodule(parent),
            attr,
            GGUFLinear(_in_features(old), pieces, getattr(old, "bias", None) is not None, matmul, row_tp),
        )
        swapped.update(kind for kind, _ in pieces if kind != "dense")
    kept = ", ".join(f"{k} {n}" for k, n in sorted(swapped.items())) or "none"
    left = ", ".join(f"{k} ({n} tensors)" for k, n in sorted(plan.dequantized.items()))
    split = ", ".join(f"{k} ({n} tensors)" for k, n in sorted(plan.split_in_blocks.items()))
    if tp.rank == 0:
        logger.info("GGUF weights kept quantized on the device: %s (pieces)%s%s", kept,
                    f"; formats not kept, dequantized at load: {left}" if left else "",
                    f"; dequantized at load because {tp.world_size} ranks would split their rows inside a "
                    f"block (row-parallel inputs): {split}" if split else "")  # fmt: skip
    return plan


def _in_features(layer: nn.Module) -> int:
    """A plain linear layer's input width."""
    return layer.in_features if hasattr(layer, "in_features") else layer.weight.shape[1]


class GGUFKeptLoader:
    """Loads the kept layers' parts from the file (blocks as they are, other formats dequantized
    into their dense rows); `take` is `iter_gguf_weights`'s hook, `finish` names what was filled."""

    def __init__(self, model: nn.Module, ckpt: GGUFCheckpoint, arch: ModelArch, tp: TPGroup = SINGLE) -> None:
        from llmserve.model.registry import family_for_gguf

        self.model, self.ckpt, self.arch, self.tp = model, ckpt, arch, tp
        self.family = family_for_gguf(ckpt.architecture)
        self.plan = keep_plan(ckpt, arch, tp.world_size)
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, GGUFLinear)}
        self.done: set[str] = set()

    def take(self, name: str, t: GGUFTensor) -> bool:
        place = self.plan.parts.get(name)
        if place is None or place.module not in self.layers:
            return False
        piece = self.layers[place.module].pieces[place.piece]
        rows, inputs = t.shape[0], t.shape[1]
        ws, rank = self.tp.world_size, self.tp.rank
        row = place.module in self.plan.row_parallel  # this rank: its inputs of every row, else its rows
        local_rows, local_in = (rows, inputs // ws) if row else (rows // ws, inputs)
        if isinstance(piece, GGUFBlocks):
            if t.type_name != piece.type_name or local_in != piece.in_features:
                raise ValueError(f"GGUF tensor {t.name}: {t.type_name} {tuple(t.shape)} does not fit its kept layer")
            raw = torch.from_numpy(np.array(t.data, copy=True).view(np.uint8)).reshape(rows, -1)
            raw = raw[_row_permutation(self.family, name, rows, self.arch, self.ckpt.architecture)]
            if row:  # whole blocks: each rank's inputs start and end on a block (keep_plan)
                width = raw.shape[1] // ws
                raw = raw[:, rank * width : (rank + 1) * width]
            else:
                raw = raw[rank * local_rows : (rank + 1) * local_rows]
            fields = piece.fields()
            with torch.no_grad():
                for field, value in split_blocks(raw.contiguous(), piece.format, local_rows).items():
                    fields[field][place.offset : place.offset + local_rows].copy_(value)
        else:
            assert isinstance(piece, DenseRows)
            weight = dequantize(t.data, t.type_name, t.shape)
            weight = self.family.gguf_tensor_values(name, weight, self.arch, self.ckpt.architecture)
            weight = rank_slice(weight, 1, local_in, rank) if row else rank_slice(weight, 0, local_rows, rank)
            with torch.no_grad():
                piece.weight[place.offset : place.offset + local_rows].copy_(weight)
        self.done.add(name)
        return True

    def finish(self) -> set[str]:
        """The kept layers' parameters, as `expected_weight_keys` names them; a missing part is an error."""
        missing = [n for n, p in self.plan.parts.items() if p.module in self.layers and n not in self.done]
        if missing:
            raise ValueError(
                f"the GGUF file lacks {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            )
        loaded = set()
        for module, layer in self.layers.items():
            fused = ".qkv_proj" in module or ".gate_up_proj" in module
            n_parts = 3 if ".qkv_proj" in module else 2
            for pname, _ in layer.named_parameters():
                if pname == "bias":
                    continue
                full = f"{module}.{pname}"
                loaded |= {f"{full}#{i}" for i in range(n_parts)} if fused else {full}
        return loaded


def gguf_kept_loader(model: nn.Module, model_path: Path, arch: ModelArch,
                     tp: TPGroup = SINGLE) -> GGUFKeptLoader | None:  # fmt: skip
    """The loader for a model with kept GGUF layers (this rank's share of them), or None."""
    if not model_path.is_file() or not any(isinstance(m, GGUFLinear) for m in model.modules()):
        return None
    from llmserve.model.gguf.checkpoint import open_gguf

    return GGUFKeptLoader(model, open_gguf(model_path), arch, tp)


__all__ = ["GGUFKeptLoader", "KeepPlan", "gguf_kept_loader", "keep_gguf_quantized", "keep_plan"]
