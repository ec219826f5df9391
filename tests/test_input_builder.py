"""The step's flattened inputs, built on the host with no model and no device
(llmserve/engine/input_builder.py): positions, KV slots, query offsets, sampling rows, the
tokens a still-running step fills in, and the block tables kept between steps."""

from __future__ import annotations

import numpy as np
import pytest

from llmserve.engine.input_builder import InputBuilder, RowInput
from llmserve.engine.request import PLACEHOLDER

pytestmark = pytest.mark.unit


def test_a_mixed_step_is_flattened_row_by_row():
    builder = InputBuilder(block_size=4, max_num_seqs=4, max_blocks=8)
    prefill = RowInput("a", [7, 2, 9], 2, 7, list(range(100, 109)), True)  # a chunk from position 2 to 8
    chunk = RowInput("b", [5, 6], 0, 5, list(range(200, 210)), False)  # a prompt's first chunk: no sample
    decode = RowInput("c", [3], 3, 1, [300, 301, 302, PLACEHOLDER], True)  # its token: the running step's
    batch = builder.build([prefill, chunk, decode], last_rows={"c": 5})
    assert list(batch.input_ids) == [*range(102, 109), *range(200, 205), PLACEHOLDER]
    assert list(batch.positions) == [*range(2, 9), *range(5), 3]
    # slot = block id * block size + offset in the block
    assert list(batch.slot_mapping) == [7 * 4 + 2, 7 * 4 + 3, 2 * 4, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 9 * 4,
                                  5 * 4, 5 * 4 + 1, 5 * 4 + 2, 5 * 4 + 3, 6 * 4, 3 * 4 + 3]  # fmt: skip
    assert batch.query_start_loc == [0, 7, 12, 13] and batch.seq_lens == [9, 5, 4]
    assert batch.logits_indices == [6, 12] and batch.max_query_len == 7
    assert batch.fill_positions == [12] and batch.fill_rows == [5]
    # 16 columns at most (a multiple of 16 keeps the kernel's stride specialisation): here all 8
    assert batch.block_tables.tolist() == [[7, 2, 9, 0, 0, 0, 0, 0], [5, 6, 0, 0, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0, 0, 0]]
    assert batch.num_decode_seqs == 0  # the decode is not at the front


def reference_flat(rows: list[RowInput], block_size: int, last_rows: dict[str, int]) -> tuple[list, list, list, list]:
    """Token by token: each new token's id, position, KV slot; and the fill positions."""
    ids, positions, slots, fills = [], [], [], []
    for row in rows:
        for p in range(row.start, row.start + row.count):
            if row.token_ids[p] == PLACEHOLDER:
                fills.append((len(ids), last_rows[row.request_id]))
            ids.append(row.token_ids[p])
            positions.append(p)
            slots.append(row.block_ids[p // block_size] * block_size + p % block_size)
    return ids, positions, slots, fills


def test_decode_rows_as_lists_chunks_as_arrays_match_the_token_by_token_reference():
    import random

    rng = random.Random(3)
    for _trial in range(60):
        builder = InputBuilder(block_size=4, max_num_seqs=8, max_blocks=16)
        rows, last_rows = [], {}
        for i in range(rng.randrange(1, 7)):
            blocks = rng.sample(range(1, 40), 12)
            if rng.random() < 0.5:  # a decode, its token known or still on the device
                start = rng.randrange(0, 40)
                tokens = [rng.randrange(500) for _ in range(start)] + [rng.choice([7, PLACEHOLDER])]
                rows.append(RowInput(f"r{i}", blocks, start, 1, tokens, True))
                last_rows[f"r{i}"] = rng.randrange(8)
            else:  # a chunk, maybe after a cached prefix
                start, count = rng.randrange(0, 20), rng.randrange(2, 25)
                rows.append(RowInput(f"r{i}", blocks, start, count, [rng.randrange(500) for _ in range(start + count)],
                                     rng.random() < 0.5))  # fmt: skip
        batch = builder.build(rows, last_rows)
        ids, positions, slots, fills = reference_flat(rows, 4, last_rows)
        assert list(batch.input_ids) == ids and list(batch.positions) == positions
        assert list(batch.slot_mapping) == slots
        assert list(zip(batch.fill_positions, batch.fill_rows)) == fills
        chunked = any(r.count > 1 for r in rows)
        for values in (batch.input_ids, batch.positions, batch.slot_mapping):  # the form the copies take
            assert isinstance(values, np.ndarray) if chunked else isinstance(values, list)
            if chunked:
                assert values.dtype == np.int64


def test_the_table_width_is_a_multiple_of_16_up_to_the_table():
    builder = InputBuilder(block_size=4, max_num_seqs=2, max_blocks=40)
    for blocks, width in ((3, 16), (16, 16), (17, 32), (33, 40)):
        batch = builder.build([RowInput("a", list(range(1, blocks + 1)), 0, 1, [0], True)])
        assert batch.block_tables.shape == (1, width)
        assert batch.block_tables[0, :blocks].tolist() == list(range(1, blocks + 1))


def test_the_decodes_leading_a_step_are_counted_for_attention():
    builder = InputBuilder(block_size=4, max_num_seqs=4, max_blocks=4)
    rows = [RowInput("a", [1], 2, 1, [5, 6, 7], True), RowInput("b", [2], 0, 1, [8], True),
            RowInput("c", [3], 0, 3, [1, 2, 3], True), RowInput("d", [0], 1, 1, [4, 5], True)]  # fmt: skip
    batch = builder.build(rows)
    assert batch.num_decode_seqs == 2  # a, b; d comes after the prefill c
    assert batch.metadata(__import__("torch").device("cpu")).num_decode_seqs == 2
    assert builder.build(rows[:2]).num_decode_seqs == 2


def test_block_tables_follow_the_requests_between_steps():
    builder = InputBuilder(block_size=4, max_num_seqs=2, max_blocks=4)
    a_blocks, b_blocks = [1], [2, 3]
    builder.build([RowInput("a", a_blocks, 0, 3, [1, 2, 3], True), RowInput("b", b_blocks, 0, 6, [0] * 6, True)])
    a_blocks.append(4)  # a grew a block: only it is copied; b finished and left its row
    batch = builder.build([RowInput("a", a_blocks, 4, 1, [1, 2, 3, 9, 8], True)])
    assert batch.block_tables.tolist() == [[1, 4, 0, 0]] and batch.slot_mapping == [4 * 4]
    again = [6, 7]  # b back after a preemption: a new list, copied afresh into a free row
    batch = builder.build([RowInput("b", again, 0, 5, [0] * 5, True), RowInput("a", a_blocks, 5, 1, [0] * 6, True)])
    assert batch.block_tables.tolist()[0][:2] == [6, 7] and batch.block_tables.tolist()[1][:2] == [1, 4]
    builder.forget_all()
    assert not builder.block_tables._rows
    with pytest.raises(ValueError, match="more than the table's 4"):
        builder.build([RowInput("c", list(range(5)), 0, 1, [0], True)])


def test_to_device_makes_the_attention_metadata():
    import torch

    builder = InputBuilder(block_size=2, max_num_seqs=2, max_blocks=4)
    batch = builder.build([RowInput("a", [3, 1], 0, 3, [5, 6, 7], True)])
    ids, positions, meta = batch.to_device(torch.device("cpu"))
    assert ids.tolist() == [5, 6, 7] and positions.tolist() == [0, 1, 2]
    assert meta.slot_mapping.tolist() == [6, 7, 2] and meta.max_seq_len == 3 and meta.max_query_len == 3
    assert np.array_equal(meta.block_tables.numpy(), [[3, 1, 0, 0]])  # the table's 4 columns


def test_a_decode_batch_by_columns_matches_the_row_by_row_build():
    """`build`'s decode-only path (a column at a time) against its general loop on the same
    rows: placeholders filled from the last step, a row that does not sample, two KV groups."""
    import dataclasses
    import random

    rng = random.Random(0)
    for groups in (1, 2):
        fast = InputBuilder(block_size=4, max_num_seqs=8, max_blocks=8, groups=groups)
        slow = InputBuilder(block_size=4, max_num_seqs=8, max_blocks=8, groups=groups)
        for _ in range(20):
            rows, last_rows = [], {}
            for i in range(rng.randint(1, 8)):
                start = rng.randrange(30)
                tokens = [rng.randrange(100) for _ in range(start + 1)]
                if rng.random() < 0.5:
                    tokens[start] = PLACEHOLDER
                    last_rows[f"r{i}"] = rng.randrange(8)
                blocks = [rng.randrange(50) for _ in range((start // 4 + 1) * groups)]
                rows.append(RowInput(f"r{i}", blocks, start, 1, tokens, rng.random() < 0.9))
            got = fast.build(rows, last_rows)
            want = slow._build_rows(rows, tuple(zip(*rows)), last_rows)
            for f in dataclasses.fields(got):
                a, b = getattr(got, f.name), getattr(want, f.name)
                if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                    assert np.array_equal(np.asarray(a), np.asarray(b)), f.name
                else:
                    assert a == b, f.name
