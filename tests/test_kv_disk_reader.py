"""The disk tier's reads in a thread of their own (engine/kv_disk_reader.py): a request whose prefix is
on disk waits for its own blocks, while steps of other requests run; its tokens equal those of the
synchronous read (the scheduler's, as under tensor parallelism)."""

from __future__ import annotations

import random

import pytest

from llmserve import LLM, SamplingParams
from llmserve.engine.kv_disk_reader import DiskReader
from llmserve.engine.kv_disk_store import DiskStore, SlotMeta, chain_digest
from llmserve.engine.request import EngineCoreRequest

pytestmark = pytest.mark.unit

BS = 8
BLOCK_BYTES = 4096  # the test model's KV block (2 layers x K and V x 8 tokens x 2 KV heads x 32 x 4 bytes)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_the_reader_reads_a_run_up_to_its_first_miss(tmp_path):
    import torch

    store = DiskStore(str(tmp_path), 8 * 8192, 64, BS, {"model": "m"})
    metas = [SlotMeta(chain_digest(None, [i] * BS, None), (i,) * BS, True) for i in range(3)]
    for slot, meta in enumerate(metas[:2]):
        store.write(slot, meta, torch.full((64,), slot, dtype=torch.uint8))
    store.flush()
    reader = DiskReader(store.read_block)
    got = reader.submit([(0, metas[0]), (1, metas[1]), (2, metas[2]), (0, metas[0])]).result(timeout=10)
    assert list(got) == [m.digest for m in metas]  # (the fourth is not read: the third missed)
    assert got[metas[1].digest][0].tolist() == [1] * 64 and got[metas[2].digest][0] is None
    reader.close()
    store.close()


def _engine(disk_dir, llama_dir) -> LLM:
    llm = LLM(llama_dir, max_model_len=128, block_size=BS, num_gpu_blocks_override=20, admission_reserve_tokens=0,
              kv_offload_cpu_gb=4 * BLOCK_BYTES / (1 << 30), kv_offload_disk_path=str(disk_dir),
              kv_offload_disk_gb=64 * BLOCK_BYTES / (1 << 30))  # fmt: skip
    assert llm.core.kv.host.num_blocks == 4 and llm.core.kv.disk_reader is not None
    return llm


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 500) for _ in range(63)] for _ in range(n)]


def test_a_slow_disk_read_holds_up_only_its_own_request(llama_dir, tmp_path):
    """Four 64-token prompts through 20 device blocks and 4 host blocks put the first one's blocks on
    disk. It comes again beside a fresh prompt, with the reader slowed (0.3 s a block): the fresh
    one's steps run while its blocks are read, and it finishes first; the tokens equal those of an
    engine that reads in the scheduler (the reference), and both load the same blocks from disk."""
    warm, (fresh,) = _prompts(4, 5), _prompts(1, 9)
    results = {}
    for threaded in (True, False):
        llm = _engine(tmp_path / str(threaded), llama_dir)
        llm.generate([{"prompt_token_ids": p} for p in warm], GREEDY, use_tqdm=False)
        core, kv = llm.core, llm.core.kv
        if threaded:
            kv.disk_reader.delay_s = 0.3
        else:
            kv.disk_reader = None  # the synchronous read
        loaded = llm.stats().kv_disk_loaded_blocks
        core.add_request(EngineCoreRequest("disk", warm[0], GREEDY, 6, (2,)))
        core.add_request(EngineCoreRequest("fresh", fresh, GREEDY, 6, (2,)))
        tokens, finished, fresh_steps_while_reading = {}, [], 0
        while core.has_unfinished():
            reading = "disk" in kv._disk_reads and not kv._disk_reads["disk"].done()
            outs = core.step().outputs
            for o in outs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason:
                    finished.append(o.request_id)
            if reading and any(o.request_id == "fresh" for o in outs):
                fresh_steps_while_reading += 1
        disk_blocks = llm.stats().kv_disk_loaded_blocks - loaded
        results[threaded] = (tokens, disk_blocks)
        if threaded:
            assert fresh_steps_while_reading >= 1 and finished[0] == "fresh", (fresh_steps_while_reading, finished)
        assert disk_blocks > 0 and kv.pool.num_used == 0 and not kv._disk_reads and not kv._disk_ready
        llm.shutdown()
    assert results[True] == results[False]


def test_an_abort_while_its_blocks_are_read_leaves_nothing(llama_dir, tmp_path):
    llm = _engine(tmp_path, llama_dir)
    warm = _prompts(4, 5)
    llm.generate([{"prompt_token_ids": p} for p in warm], GREEDY, use_tqdm=False)
    core, kv = llm.core, llm.core.kv
    kv.disk_reader.delay_s = 0.2
    core.add_request(EngineCoreRequest("disk", warm[0], GREEDY, 6, (2,)))
    core.step()
    assert "disk" in kv._disk_reads
    core.abort_requests(["disk"])
    assert not kv._disk_reads and not kv._disk_ready and not core.has_unfinished()
    kv.disk_reader.delay_s = 0.0
    again = llm.generate([{"prompt_token_ids": warm[0]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert len(again) == 6 and kv.pool.num_used == 0
    llm.shutdown()
