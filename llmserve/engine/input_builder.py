"""One step's model inputs, flattened on the host from the scheduled rows: token ids,
positions, KV slot of each new token, query offsets, sequence lengths, block tables, the
rows that sample, and the input tokens a still-running step has yet to deliver.

Pure host work with no device and no model, so the tests check it on any machine. The
model runner turns the result into device tensors (`BatchInputs.to_device`), or copies it
into a CUDA graph's buffers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from llmserve.attention_metadata import AttentionMetadata, SampledRows
from llmserve.engine.block_table import BlockTableBuffer
from llmserve.engine.request import PLACEHOLDER
from llmserve.host_copy import to_device

TABLE_WIDTH_STEP = 16


def table_width(blocks: int, most: int | None = None) -> int:
    """Block-table columns for `blocks`: a multiple of TABLE_WIDTH_STEP (at most `most`). The
    width is the attention kernel's row stride, and Triton compiles a kernel once for strides
    divisible by 16 and again for the others (in the middle of a run)."""
    width = -(-blocks // TABLE_WIDTH_STEP) * TABLE_WIDTH_STEP
    return width if most is None else min(width, most)


class RowInput(NamedTuple):
    """One scheduled request's part of a step, as the input builder reads it."""

    request_id: str
    block_ids: list[int]  # the request's block table (BlockTableBuffer copies only what is new)
    start: int  # its first new position (tokens before it are in the KV cache)
    count: int  # how many new tokens this step
    token_ids: list[int]  # all its tokens; PLACEHOLDER where the running step has not delivered one
    samples: bool  # the step reaches its last token: a new token is sampled
    # speculative decoding: the proposed tokens at the end of `token_ids`; every one of the row's
    # positions then gives logits (for verification), not just the last
    drafts: tuple[int, ...] = ()
    draft_probs: torch.Tensor | None = None  # [len(drafts), V] what they were drawn from (a draft model's)


@dataclass(slots=True)
class BatchInputs:
    """One flattened batch, on the host; `to_device` makes the model's inputs."""

    # lists for a batch of decode rows, int64 numpy arrays when a chunk of several tokens is in it
    input_ids: list[int] | np.ndarray
    positions: list[int] | np.ndarray
    slot_mapping: list[int] | np.ndarray
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: np.ndarray  # [B, max_blocks] int32
    logits_indices: list[int]  # rows of the hidden states that sample
    max_query_len: int
    # input tokens sampled by the previous, still running step (PLACEHOLDER here): flat
    # positions in input_ids and the rows of that step's device tokens that fill them
    fill_positions: list[int]
    fill_rows: list[int]
    num_decode_seqs: int = 0  # rows at the front with one new token each
    fresh_seqs: tuple[tuple[int, int, int], ...] = ()  # AttentionMetadata.fresh_seqs
    chunk_seqs: tuple[tuple[int, int, int, int], ...] = ()  # AttentionMetadata.chunk_seqs
    sample_seqs: list[int] = field(default_factory=list)  # the sequence of each row in logits_indices
    verifies: bool = False  # some row speculates: several logits rows of one sequence (RowInput.drafts)
    # several KV groups (engine/kv_layout.py): slot_mapping and block_tables above are group 0's;
    # these are groups 1, 2, ...'s: [G - 1, T] int64 and [G - 1, B, max_blocks] int32
    group_slots: np.ndarray | None = None
    group_tables: np.ndarray | None = None

    def to_device(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        return (
            to_device(self.input_ids, torch.long, device),
            to_device(self.positions, torch.long, device),
            self.metadata(device),
        )

    def metadata(self, device: torch.device) -> AttentionMetadata:
        def t(values, dtype):
            return to_device(values, dtype, device)

        meta = AttentionMetadata(
            slot_mapping=t(self.slot_mapping, torch.long),
            query_start_loc=t(self.query_start_loc, torch.int32),
            seq_lens=t(self.seq_lens, torch.int32),
            block_tables=t(self.block_tables, torch.int32),
            max_query_len=self.max_query_len,
            max_seq_len=max(self.seq_lens),
            num_decode_seqs=self.num_decode_seqs,
            fresh_seqs=self.fresh_seqs,
            chunk_seqs=self.chunk_seqs,
        )
        if self.group_slots is not None:
            meta.groups = tuple(
                dataclasses.replace(meta, slot_mapping=t(slots, torch.long), block_tables=t(table, torch.int32))
                for slots, table in zip(self.group_slots, self.group_tables)
            )
        return meta

    def sampled_rows(self, meta: AttentionMetadata, device: torch.device) -> SampledRows:
        """The rows of `logits_indices`, and the attention of their queries alone over the cache
        (each a one-token query at its sequence's end); `meta` is the whole batch's, whose slot
        mapping stays (every row's keys and values are still written)."""
        seqs = self.sample_seqs
        seq_lens = [self.seq_lens[i] for i in seqs]
        sampled = AttentionMetadata(
            slot_mapping=meta.slot_mapping,
            query_start_loc=to_device(list(range(len(seqs) + 1)), torch.int32, device),
            seq_lens=to_device(seq_lens, torch.int32, device),
            block_tables=to_device(self.block_tables[seqs], torch.int32, device),
            max_query_len=1,
            max_seq_len=max(seq_lens, default=0),
            num_decode_seqs=len(seqs),
        )
        if self.group_tables is not None:
            sampled.groups = tuple(
                dataclasses.replace(
                    sampled, slot_mapping=group.slot_mapping, block_tables=to_device(table[seqs], torch.int32, device)
                )  # fmt: skip
                for group, table in zip(meta.groups, self.group_tables)
            )
        return SampledRows(rows=to_device(self.logits_indices, torch.long, device), meta=sampled)


class InputBuilder:
    """Flattens steps; keeps the running requests' block tables between steps. Chunks after a
    cached prefix are listed (`chunk_seqs`) when the whole sequence is at most `chunk_total_limit`
    tokens (0: none listed). With `groups` KV groups a request's block list interleaves the groups'
    ids (engine/kv_layout.py), and each group gets its own slots and block tables."""

    def __init__(self, block_size: int, max_num_seqs: int, max_blocks: int, chunk_total_limit: int = 0,
                 groups: int = 1) -> None:  # fmt: skip
        self.block_size = block_size
        self.chunk_total_limit = chunk_total_limit
        self.groups = groups
        self.max_blocks = max_blocks  # a group's columns
        self.block_tables = BlockTableBuffer(max_num_seqs, max_blocks * groups)

    def build(self, rows: list[RowInput], last_rows: dict[str, int] | None = None) -> BatchInputs:
        """Decode rows take a fast path: one token, one slot. `last_rows`: request id -> row of
        the still-running previous step's tokens, for decode rows whose input token is a
        PLACEHOLDER."""
        columns = tuple(zip(*rows))  # request ids, tables, starts, counts, tokens, samples, drafts, draft probs
        if rows and columns[3].count(1) == len(rows):
            return self._build_decodes(columns, last_rows)
        return self._build_rows(rows, columns, last_rows)

    def _build_rows(self, rows: list[RowInput], columns: tuple[tuple, ...],
                    last_rows: dict[str, int] | None) -> BatchInputs:  # fmt: skip
        """`build` row by row: any mix of decodes, chunks and speculating rows."""
        bs = self.block_size
        # decode rows go to plain lists; a chunk of several tokens comes as numpy arrays (its
        # positions a range, its slots computed from its table: no list of 7,680 ints made and
        # then converted again to be copied), and a batch with any chunk is joined into arrays
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        parts: list[tuple] = []  # (ids, positions, slots) per run of decode rows or per chunk, in row order
        num_tokens = 0
        query_start = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sample_seqs: list[int] = []
        max_query = 0
        fill_positions: list[int] = []
        fill_rows: list[int] = []
        decode_lead = 0
        fresh: list[tuple[int, int, int]] = []
        chunks: list[tuple[int, int, int, int]] = []
        for request_id, table, start, count, tokens, samples, drafts, _ in rows:
            end = start + count
            if count == 1:
                token = tokens[start]
                if token == PLACEHOLDER:
                    fill_positions.append(num_tokens)
                    fill_rows.append(last_rows[request_id])
                input_ids.append(token)
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                if start == 0:  # no cached prefix
                    fresh.append((len(seq_lens), query_start[-1], count))
                elif end <= self.chunk_total_limit:
                    chunks.append((len(seq_lens), query_start[-1], count, start))
                if input_ids:
                    parts.append((input_ids, positions, slots))
                    input_ids, positions, slots = [], [], []
                pos = np.arange(start, end, dtype=np.int64)
                parts.append((tokens[start:end], pos, np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs))
            num_tokens += count
            if count == 1 and decode_lead == len(seq_lens):
                decode_lead += 1
            query_start.append(query_start[-1] + count)
            seq_lens.append(end)
            max_query = max(max_query, count)
            if drafts:
                logits_indices.extend(range(query_start[-1] - count, query_start[-1]))
                sample_seqs.extend([len(seq_lens) - 1] * count)
            elif samples:
                logits_indices.append(query_start[-1] - 1)
                sample_seqs.append(len(seq_lens) - 1)
        if parts:
            if input_ids:
                parts.append((input_ids, positions, slots))
            input_ids, positions, slots = (np.concatenate([np.asarray(p[i], dtype=np.int64) for p in parts])
                                           for i in range(3))  # fmt: skip
        table_rows = self.block_tables.rows_of(columns[0], columns[1])
        # copy only the columns this batch uses (`table_width`)
        groups = self.groups
        width = table_width(max(map(len, columns[1])) // groups, self.max_blocks)
        batch = BatchInputs(
            input_ids, positions, slots, query_start, seq_lens,
            self.block_tables.table[table_rows, : width * groups], logits_indices, max_query, fill_positions,
            fill_rows, decode_lead, tuple(fresh), tuple(chunks), sample_seqs,
        )  # fmt: skip
        if groups > 1:
            self._split_groups(batch, width)
        batch.verifies = max_query > 1 and any(row.drafts for row in rows)  # (a draft makes a row of several)
        return batch

    def _build_decodes(self, columns: tuple[tuple, ...], last_rows: dict[str, int] | None) -> BatchInputs:
        """`build` for a batch of decode rows (one new token each, so no drafts), a column at a
        time: what `build`'s loop makes of the same rows (tests/test_input_builder.py compares)."""
        ids, tables, starts, _, tokens, samples = columns[:6]
        bs, n = self.block_size, len(ids)
        input_ids = [t[s] for t, s in zip(tokens, starts)]
        fill_positions = [i for i, t in enumerate(input_ids) if t == PLACEHOLDER] if PLACEHOLDER in input_ids else []
        fill_rows = [last_rows[ids[i]] for i in fill_positions]
        if samples.count(True) == n:
            logits_indices, sample_seqs = list(range(n)), list(range(n))
        else:
            logits_indices = [i for i, s in enumerate(samples) if s]
            sample_seqs = list(logits_indices)
        groups = self.groups
        width = table_width(max(map(len, tables)) // groups, self.max_blocks)
        table_rows = self.block_tables.rows_of(ids, tables)
        batch = BatchInputs(
            input_ids, list(starts), [t[s // bs] * bs + s % bs for t, s in zip(tables, starts)], list(range(n + 1)),
            [s + 1 for s in starts], self.block_tables.table[table_rows, : width * groups], logits_indices, 1,
            fill_positions, fill_rows, n, (), (), sample_seqs,
        )  # fmt: skip
        if groups > 1:
            self._split_groups(batch, width)
        return batch

    def _split_groups(self, batch: BatchInputs, width: int) -> None:
        """Each group's slots and block table, from the interleaved tables (the slots the loop in
        `build` made read the tables as one group's)."""
        groups, bs = self.groups, self.block_size
        tables = batch.block_tables.reshape(len(batch.seq_lens), width, groups)
        seq_of_token = np.repeat(np.arange(len(batch.seq_lens)), np.diff(batch.query_start_loc))
        pos = np.asarray(batch.positions, dtype=np.int64)
        slots = tables[seq_of_token, pos // bs].astype(np.int64) * bs + (pos % bs)[:, None]  # [T, G]
        batch.slot_mapping = np.ascontiguousarray(slots[:, 0])
        batch.group_slots = np.ascontiguousarray(slots[:, 1:].T)
        batch.block_tables = np.ascontiguousarray(tables[:, :, 0])
        batch.group_tables = np.ascontiguousarray(tables[:, :, 1:].transpose(2, 0, 1))

    def forget_all(self) -> None:
        """Release every request's row (after a profile run's made-up requests)."""
        self.block_tables.rows_for([])
