"""Pipeline parallelism inside the model: which decoder layers a stage holds.

A model split over `count` stages keeps, on stage i, a contiguous run of its decoder layers; the
first stage also holds the embedding, the last the final norm and the LM head (and the embedding
too when the head is tied to it). The layers a stage does not hold are `MissingLayer`s, set while
the model is still on the meta device, so they never get memory; the checkpoint's tensors of
those parts are skipped as they load (`stage_keeps`). Between stages travel the hidden states and
the residual of every token of the step (engine/pp_stages.py sends them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """Stage `index` of `count`: decoder layers [start, end) (end None: to the last layer)."""

    index: int = 0
    count: int = 1
    start: int = 0
    end: int | None = None

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    @property
    def whole(self) -> bool:
        return self.count == 1

    def layers(self, num_layers: int) -> range:
        return range(self.start, num_layers if self.end is None else self.end)

    def holds(self, layer: int) -> bool:
        return layer >= self.start and (self.end is None or layer < self.end)


WHOLE = PipelineStage()


def split_layers(num_layers: int, count: int) -> list[tuple[int, int]]:
    """[start, end) of each stage: as even as it goes, the extra layers on the earliest stages
    (the last stage also runs the LM head and samples)."""
    base, extra = divmod(num_layers, count)
    bounds, start = [], 0
    for i in range(count):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def pipeline_stage(num_layers: int, count: int, index: int) -> PipelineStage:
    if count == 1:
        return WHOLE
    start, end = split_layers(num_layers, count)[index]
    return PipelineStage(index, count, start, end)


def check_pp_shape(num_layers: int, count: int) -> str | None:
    """Why a model of `num_layers` decoder layers cannot be split into `count` stages, or None."""
    if count < 1:
        return f"pipeline_parallel_size must be >= 1, got {count}"
    if count > num_layers:
        return f"pipeline_parallel_size {count} is more than the model's {num_layers} decoder layers"
    return None


class MissingLayer(nn.Module):
    """The place of a part another pipeline stage holds: no parameters, never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this pipeline stage does not hold that layer")


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_FINAL_NORM = re.compile(r"(?:^|\.)norm\.(?:weight|bias)$")


def stage_keeps(name: str, stage: PipelineStage, tied_embeddings: bool) -> bool:
    """Whether a checkpoint tensor (by its Hugging Face name) belongs to `stage`: a decoder
    layer's to the stage holding it, the embedding's to the first (and the last when the head is
    tied to it), the final norm's and the head's to the last; anything else to every stage."""
    if stage.whole:
        return True
    match = _LAYER.search(name)
    if match:
        return stage.holds(int(match.group(1)))
    if "embed_tokens." in name:
        return stage.is_first or (stage.is_last and tied_embeddings)
    if name.startswith("lm_head.") or ".lm_head." in name or _FINAL_NORM.search(name):
        return stage.is_last
    return True
