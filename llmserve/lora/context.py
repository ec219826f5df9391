"""The per-step token -> slot mapping that every LoRA layer of one model reads.

Fixed buffers sized for the largest batch, filled once per step (by the model runner, or a
test): the grouping by slot is computed on the host and copied in, so the layers (and CUDA
graphs captured over them) always read the same addresses and nothing depends on the values
in Python. Tokens past the step's count read NO_ADAPTER (padding in a captured graph).
A step without adapters skips the LoRA ops, unless `always_apply` (a CUDA graph is captured once
and must contain them: with every token at NO_ADAPTER each kernel program returns at once).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmserve.host_copy import staged
from llmserve.lora_batch import (
    NO_ADAPTER,
    LoRABatch,
    check_token_slots,
    group_by_slot,
    max_row_blocks,
    row_block,
    slot_row_blocks,
)


class LoRAContext:
    def __init__(self, max_num_tokens: int, num_slots: int, device: torch.device | str = "cpu",
                 always_apply: bool = False) -> None:  # fmt: skip
        self.always_apply = always_apply
        self.max_num_tokens = max_num_tokens
        self.num_slots = num_slots
        self.device = torch.device(device)
        # the kernels' row-block tables for both block sizes (row_block: 16 up to 64 tokens)
        self._table_rows = {16: max_row_blocks(min(max_num_tokens, 64), num_slots),
                            64: max_row_blocks(max(max_num_tokens, 65), num_slots)}  # fmt: skip
        tables = 2 * sum(self._table_rows.values())
        # one buffer, [slot_starts | slot_counts | tables | token_slots | sorted_tokens], so that a
        # step's values arrive in two copies from pinned memory (a copy from pageable memory
        # would wait for the step running on the GPU: llmserve/host_copy.py)
        head = 2 * num_slots + tables
        packed = torch.zeros(head + 2 * max_num_tokens, dtype=torch.int32, device=self.device)
        self.slot_starts = packed[:num_slots]
        self.slot_counts = packed[num_slots : 2 * num_slots]
        small = 2 * num_slots + 2 * self._table_rows[16]
        self.row_blocks = {16: packed[2 * num_slots : small].view(-1, 2), 64: packed[small:head].view(-1, 2)}
        self.token_slots = packed[head : head + max_num_tokens].fill_(NO_ADAPTER)
        self.sorted_tokens = packed[head + max_num_tokens :]
        self._head = packed[: head + max_num_tokens]  # starts, counts, tables, then the token slots
        self.num_tokens = 0  # tokens set by the last `set_token_slots`
        self.has_adapters = False

    def set_token_slots(self, token_slots: Sequence[int] | torch.Tensor) -> None:
        """This step's slot of each token (NO_ADAPTER: the base model), from the host."""
        slots = torch.as_tensor(token_slots, dtype=torch.int32, device="cpu").reshape(-1)
        n = slots.shape[0]
        if n > self.max_num_tokens:
            raise ValueError(f"{n} tokens, the LoRA context holds at most {self.max_num_tokens}")
        check_token_slots(slots, self.num_slots)
        sorted_tokens, starts, counts = group_by_slot(slots, self.num_slots)
        tables = [slot_row_blocks(counts, block, rows).reshape(-1) for block, rows in self._table_rows.items()]
        head = torch.cat([starts, counts, *tables, slots])
        self._head[: head.shape[0]].copy_(staged(head, torch.int32, self.device), non_blocking=True)
        self.token_slots[n:].fill_(NO_ADAPTER)
        self.sorted_tokens[:n].copy_(staged(sorted_tokens, torch.int32, self.device), non_blocking=True)
        self.num_tokens = n
        self.has_adapters = bool((slots != NO_ADAPTER).any())

    def clear(self) -> None:
        """No token uses an adapter (the base model alone)."""
        self.set_token_slots([])

    def batch(self, num_tokens: int) -> LoRABatch:
        """The LoRABatch of a layer input of `num_tokens` rows (at least the tokens set: more
        are padding)."""
        if not self.num_tokens <= num_tokens <= self.max_num_tokens:
            raise ValueError(f"a LoRA layer got {num_tokens} tokens; the step set {self.num_tokens} "
                             f"(at most {self.max_num_tokens})")  # fmt: skip
        return LoRABatch(self.token_slots[:num_tokens], self.sorted_tokens, self.slot_starts, self.slot_counts,
                         self.has_adapters or self.always_apply, self.row_blocks[row_block(num_tokens)])  # fmt: skip
