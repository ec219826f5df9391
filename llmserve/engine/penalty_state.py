"""What repetition, presence and frequency penalties need, kept on the device.

Each request with a penalty gets a row (a slot) for its life: how often each token appeared
in its output (int32 counts), and, with a repetition penalty, which tokens its prompt holds.
The counts grow on the device from the sampled tokens themselves, so a step can be
scheduled before the host has read the previous step's tokens (async scheduling), and no
per-request tensor is built per step. The reference that recomputes all of this from the
token lists is `sampler_reference.apply_penalties`. On a GPU the penalties go on in one pass
of a Triton kernel (`llmserve.kernels.sampling.apply_penalties_`); `apply_tensors` is the same
in tensor ops, the CPU's path and the kernel's reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmserve.engine.request import PLACEHOLDER
from llmserve.host_copy import kept_on_device, to_device


@dataclass(slots=True)
class PenaltyRows:
    """This step's rows with penalties: their positions in the batch, their slots, their
    settings (host lists, copied to the device together)."""

    rows: list[int]
    slots: list[int]
    repetition: list[float]
    presence: list[float]
    frequency: list[float]
    copies: dict[str, torch.Tensor] = field(default_factory=dict)  # the lists on the device (`kept_on_device`)


class PenaltyState:
    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 16, use_kernel: bool = False) -> None:
        self.vocab = vocab_size
        self.device = device
        self.use_kernel = use_kernel  # the Triton kernel (a GPU, or the interpreter in tests)
        self.capacity = capacity
        self.counts: torch.Tensor | None = None  # int32 [capacity, vocab], made on first use
        self.prompt_seen: torch.Tensor | None = None  # bool [capacity, vocab], with the first repetition penalty
        self.slot_of: dict[str, int] = {}
        self.free: list[int] = []

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            slot = self.slot_of.pop(request_id, None)
            if slot is not None:
                self.free.append(slot)

    def _ensure(self, needed: int) -> None:
        """Rows for `needed` requests at once (allocated on first use, doubled when short)."""
        old = 0 if self.counts is None else self.capacity
        if self.counts is not None and needed <= old:
            return
        capacity = max(needed, self.capacity if self.counts is None else 2 * old)
        counts = torch.zeros(capacity, self.vocab, dtype=torch.int32, device=self.device)
        if self.counts is not None:
            counts[:old] = self.counts
        self.counts = counts
        if self.prompt_seen is not None:
            seen = torch.zeros(capacity, self.vocab, dtype=torch.bool, device=self.device)
            seen[:old] = self.prompt_seen
            self.prompt_seen = seen
        self.free.extend(range(old, capacity))
        self.capacity = capacity

    def rows_for(self, requests: list) -> PenaltyRows | None:
        """Slots for the batch's requests with penalties; a request seen for the first time
        gets its row filled from its prompt and the output it has so far."""
        pen = [(i, r) for i, r in enumerate(requests) if r.sampling_params.has_penalties]
        if not pen:
            return None
        new = [r for _, r in pen if r.request_id not in self.slot_of]
        if new:
            self._ensure(len(self.slot_of) + len(new))
            if self.prompt_seen is None and any(r.sampling_params.repetition_penalty != 1.0 for r in new):
                self.prompt_seen = torch.zeros(self.capacity, self.vocab, dtype=torch.bool, device=self.device)
            for r in new:
                self.slot_of[r.request_id] = self.free.pop()
            self._fill(new)
        params = [r.sampling_params for _, r in pen]
        return PenaltyRows([i for i, _ in pen], [self.slot_of[r.request_id] for _, r in pen],
                           [p.repetition_penalty for p in params], [p.presence_penalty for p in params],
                           [p.frequency_penalty for p in params])  # fmt: skip

    def _fill(self, requests: list) -> None:
        """New rows: counts of the output so far (none, unless it ran before), the prompt's tokens."""
        slots = [self.slot_of[r.request_id] for r in requests]
        index = to_device(slots, torch.long, self.device)
        self.counts.index_fill_(0, index, 0)
        out_rows, out_ids = _flat(slots, [[t for t in r.output_token_ids if t != PLACEHOLDER] for r in requests])
        if out_ids:
            ones = torch.ones(len(out_ids), dtype=torch.int32, device=self.device)
            self.counts.index_put_((to_device(out_rows, torch.long, self.device),
                                    to_device(out_ids, torch.long, self.device)), ones, accumulate=True)  # fmt: skip
        if self.prompt_seen is not None:
            self.prompt_seen.index_fill_(0, index, False)
            rows, ids = _flat(slots, [r.prompt_token_ids for r in requests])
            if ids:
                # (a device tensor as the value: a Python True is a host scalar, and its copy waits for the device)
                true = torch.ones((), dtype=torch.bool, device=self.device)
                self.prompt_seen.index_put_(
                    (to_device(rows, torch.long, self.device), to_device(ids, torch.long, self.device)), true
                )

    def apply(self, logits: torch.Tensor, pen: PenaltyRows) -> torch.Tensor:
        """The penalties on their rows of `logits` [B, V] (float32), as the reference applies
        them: repetition over prompt and output tokens, presence and frequency over the output."""
        if not self.use_kernel or logits.stride(-1) != 1:
            return self.apply_tensors(logits, pen)
        from llmserve.kernels.sampling import apply_penalties_

        rows = kept_on_device(pen, "rows", torch.long, self.device)
        slots = kept_on_device(pen, "slots", torch.long, self.device)
        rep = (
            kept_on_device(pen, "repetition", torch.float32, self.device)
            if any(r != 1.0 for r in pen.repetition)
            else None
        )
        add = any(pen.presence) or any(pen.frequency)
        presence = kept_on_device(pen, "presence", torch.float32, self.device) if add else None
        frequency = kept_on_device(pen, "frequency", torch.float32, self.device) if add else None
        return apply_penalties_(logits, self.counts, self.prompt_seen, rows, slots, rep, presence, frequency)

    def apply_tensors(self, logits: torch.Tensor, pen: PenaltyRows) -> torch.Tensor:
        """`apply` in batched tensor ops (about a dozen passes over the rows): the CPU's path
        and the kernel's reference."""
        rows = to_device(pen.rows, torch.long, self.device)
        slots = to_device(pen.slots, torch.long, self.device)
        part = logits[rows]
        counts = self.counts[slots]
        used = counts > 0
        if any(r != 1.0 for r in pen.repetition):
            rep = to_device(pen.repetition, torch.float32, self.device)[:, None]
            seen = used if self.prompt_seen is None else used | self.prompt_seen[slots]
            part = torch.where(seen, torch.where(part > 0, part / rep, part * rep), part)
        if any(pen.presence) or any(pen.frequency):
            presence = to_device(pen.presence, torch.float32, self.device)[:, None]
            frequency = to_device(pen.frequency, torch.float32, self.device)[:, None]
            part = part - (frequency * counts.to(torch.float32) + presence * used.to(torch.float32))
        logits[rows] = part
        return logits

    def count(self, tokens: torch.Tensor, pen: PenaltyRows) -> None:
        """The tokens just sampled (on the device) join their rows' counts."""
        rows = kept_on_device(pen, "rows", torch.long, self.device)
        slots = kept_on_device(pen, "slots", torch.long, self.device)
        ones = torch.ones(len(pen.rows), dtype=torch.int32, device=self.device)
        self.counts.index_put_((slots, tokens[rows]), ones, accumulate=True)


def _flat(slots: list[int], lists: list[list[int]]) -> tuple[list[int], list[int]]:
    rows: list[int] = []
    ids: list[int] = []
    for slot, values in zip(slots, lists):
        rows.extend([slot] * len(values))
        ids.extend(values)
    return rows, ids
