"""Which LoRA slot each token of one flattened batch uses, as the batched LoRA ops read it.

A leaf module (as attention_metadata.py is): the PyTorch reference (llmserve/lora/reference.py),
the Triton kernels (llmserve/kernels/lora.py) and the model's LoRA layers read it; it imports
none of them. Tokens are grouped by slot once per step, on the host, so that each kernel
program handles tokens of one slot and reads that slot's A/B tiles once for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_ADAPTER = -1  # a token's slot when its request uses the base model alone


@dataclass(frozen=True, slots=True)
class LoRABatch:
    """The adapter slots of one flattened batch of T tokens over S slots."""

    token_slots: torch.Tensor  # [T] int32: each token's slot, NO_ADAPTER for the base model
    sorted_tokens: torch.Tensor  # [>= T] int32: token indices grouped by slot (stable within a slot)
    slot_starts: torch.Tensor  # [S] int32: where slot s's tokens begin in sorted_tokens
    slot_counts: torch.Tensor  # [S] int32: how many tokens use slot s
    active: bool  # host-side: run the LoRA ops (some token uses an adapter, or a CUDA graph is captured)
    # [>= max_row_blocks(T, S), 2] int32: the kernels' row blocks of row_block(T) tokens, each
    # (slot, its first row among the slot's tokens); (-1, -1) past the last one
    row_blocks: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.slot_counts.shape[0]


def row_block(num_tokens: int) -> int:
    """How many tokens of one slot a kernel program takes, for a layer input of `num_tokens` rows."""
    return 16 if num_tokens <= 64 else 64


def max_row_blocks(num_tokens: int, num_slots: int) -> int:
    """An upper bound on the row blocks of any `num_tokens` tokens over `num_slots` slots (each
    slot's last block may be partial, and each block holds a token): the kernels' grid, which
    depends on the token count alone. One token: one block."""
    block = row_block(num_tokens)
    return min(-(-num_tokens // block) + num_slots, num_tokens)


def slot_row_blocks(slot_counts: torch.Tensor, block: int, size: int) -> torch.Tensor:
    """[size, 2] int32 host table: each slot's row blocks of `block` tokens, (slot, first row),
    in slot order, then (-1, -1) rows (at most `size` rows are kept). Kernel programs take one
    row each: none is spent on a slot without tokens, and a step of many tokens on few adapters
    launches few programs."""
    rows = [(slot, first) for slot, count in enumerate(slot_counts.tolist()) for first in range(0, count, block)]
    table = torch.full((size, 2), -1, dtype=torch.int32)
    if rows:  # past `size`: a table of a block size this step's layers do not use (too many tokens)
        table[: min(len(rows), size)] = torch.tensor(rows[:size], dtype=torch.int32)
    return table


def group_by_slot(token_slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_tokens [T], slot_starts [S], slot_counts [S]) of host `token_slots` [T], all int32."""
    keys = token_slots.to(torch.int64) + 1  # 0: no adapter, which sorts first
    order = torch.argsort(keys, stable=True)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64).scatter_add_(0, keys, torch.ones_like(keys))
    starts = torch.cumsum(counts, 0) - counts
    return order.to(torch.int32), starts[1:].to(torch.int32), counts[1:].to(torch.int32)


def make_lora_batch(token_slots: torch.Tensor, num_slots: int) -> LoRABatch:
    """A batch's LoRABatch from host `token_slots` (tests and the CPU path; the model runner
    fills fixed device buffers instead: llmserve/lora/context.py)."""
    token_slots = token_slots.to(torch.int32)
    check_token_slots(token_slots, num_slots)
    sorted_tokens, starts, counts = group_by_slot(token_slots, num_slots)
    n = token_slots.shape[0]
    blocks = slot_row_blocks(counts, row_block(n), max_row_blocks(n, num_slots))
    return LoRABatch(token_slots, sorted_tokens, starts, counts, bool((token_slots != NO_ADAPTER).any()), blocks)


def check_token_slots(token_slots: torch.Tensor, num_slots: int) -> None:
    """Every slot index in [-1, num_slots)."""
    if token_slots.numel() and (int(token_slots.min()) < NO_ADAPTER or int(token_slots.max()) >= num_slots):
        raise ValueError(f"token slots must lie in [{NO_ADAPTER}, {num_slots}), got {token_slots.tolist()}")
