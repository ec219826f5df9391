"""How a model's layers share the KV cache: groups of layers with one block table each.

A model whose layers all attend the same way (Llama: every layer sees every key) has one group:
one block table per request, one cache tensor per layer. A model that mixes full-attention and
sliding-window layers (Gemma 3: five local layers of 512 keys to each global one) gets one group
per kind of layer (several for a kind with more layers), all of `layers_per_group` layers. Each
group has its own block table, and a block id means the same memory in every group: slot i of
every group's layers lives in cache tensor i. The groups draw from one block pool, so memory goes
where it is needed; a sliding group's blocks wholly before its window are freed as the sequence
moves on, so a long sequence holds only a window's blocks in its local layers.

A request's blocks are one list, interleaved: the id of logical block i in group g sits at
`i * num_groups + g`, so the list only grows at its end (a freed block's entry becomes
`NULL_BLOCK`, which no kernel reads: it lies outside every window that reads the group).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# the reserved block a freed sliding-window entry points at (never handed out, never read)
NULL_BLOCK = 0
# a layout may waste this share of cache slots in a last, partly filled group, to have fewer groups
MAX_PADDING = 0.10


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Per group its sliding window (None: every key); per layer its group and cache slot."""

    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    layers_per_group: int  # cache tensors: one per slot

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def simple(self) -> bool:
        """One group that keeps every block: the plain paged cache."""
        return self.windows == (None,)

    @property
    def sliding(self) -> bool:
        """Some group frees blocks behind its window (the pool then reserves `NULL_BLOCK`)."""
        return any(w is not None for w in self.windows)

    def first_needed(self, group: int, position: int, block_size: int) -> int:
        """The first logical block group `group` still needs when tokens from `position` on are
        computed: 0, or for a sliding window W the block of key `position - W + 1`."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, position - window + 1) // block_size

    def blocks_held(self, start: int, end: int, block_size: int) -> int:
        """Block ids a sequence holds over every group while tokens [start, end) are computed."""
        blocks = -(-end // block_size)
        return sum(blocks - min(blocks, self.first_needed(g, start, block_size)) for g in range(self.num_groups))

    def __str__(self) -> str:
        kinds = ", ".join("full" if w is None else f"window {w}" for w in self.windows)
        return f"{self.num_groups} KV group(s) of {self.layers_per_group} layers ({kinds})"


def single_group(num_layers: int) -> KVLayout:
    return KVLayout((None,), (0,) * num_layers, tuple(range(num_layers)), num_layers)


def plan_layout(windows: Sequence[int | None], kv_widths: Sequence[int]) -> KVLayout:
    """The layout of layers with these windows (None: full attention) and per-token KV widths.

    Layers of one window form one group when all layers share it (Mistral: one sliding group).
    Mixed kinds get groups of `size` layers, the size that leaves the fewest cache slots empty
    (within MAX_PADDING, the largest such size: fewer block tables to keep). Layers of unequal
    KV widths cannot share cache tensors: one group keeping every block (their kernels still
    apply each layer's window)."""
    n = len(windows)
    if len(set(windows)) == 1:
        return KVLayout((windows[0],), (0,) * n, tuple(range(n)), n)
    if len(set(kv_widths)) != 1:
        return single_group(n)
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)

    def slots(size: int) -> int:
        return sum(math.ceil(len(layers) / size) for layers in kinds.values()) * size

    fewest = min(slots(s) for s in range(1, n + 1))
    size = max(s for s in range(1, n + 1) if slots(s) <= fewest * (1 + MAX_PADDING))
    group_windows: list[int | None] = []
    layer_group = [0] * n
    layer_slot = [0] * n
    for window, layers in kinds.items():
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                layer_group[layer] = len(group_windows)
                layer_slot[layer] = slot
            group_windows.append(window)
    return KVLayout(tuple(group_windows), tuple(layer_group), tuple(layer_slot), size)
