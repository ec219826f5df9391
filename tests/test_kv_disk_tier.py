"""The prefix cache's disk tier (engine/kv_disk_tier.py, kv_disk_store.py): blocks the host tier
evicts move to a file of fixed slots, a prefix found there is read back (checked) instead of
recomputed, and a restarted engine of the same model reuses the file."""

from __future__ import annotations

import json
import os
import random
import time

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.config import ConfigError
from llmserve.engine.block_pool import BlockKey
from llmserve.engine.kv_disk_store import DiskStore, SlotMeta, chain_digest
from llmserve.engine.kv_disk_tier import DiskTier
from llmserve.metrics import _EngineStateCollector

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BS = 8


def _digest(i: int) -> bytes:
    return chain_digest(None, [i] * BS, None)


def test_disk_tier_is_lru():
    tier = DiskTier(2)
    key = BlockKey(None, (1,), None)
    a, b = tier.store(_digest(1), key), tier.store(_digest(2), key)
    assert {a, b} == {0, 1} and tier.store(_digest(1), key) is None  # there already: nothing to write
    assert tier.lookup(_digest(1)) == a  # now the most recent: 2 goes first
    assert tier.store(_digest(3), key) == b and tier.lookup(_digest(2)) is None
    assert [e.slot for e in tier.take_dropped()] == [b]
    tier.forget(_digest(1))
    assert tier.lookup(_digest(1)) is None and tier.store(_digest(4), key) == a


def test_chain_digest_is_stable_and_chained():
    first = chain_digest(None, [1, 2, 3], None)
    assert first == chain_digest(None, [1, 2, 3], None) != chain_digest(None, [1, 2, 3], "adapter")
    assert chain_digest(first, [4], None) != chain_digest(chain_digest(None, [9, 2, 3], None), [4], None)
    # (a constant across processes: Python's hash of a BlockKey is not)
    assert first.hex() == chain_digest(None, [1, 2, 3], None).hex() and len(first) == 16


def _store(path, fingerprint=None, capacity=1 << 20) -> DiskStore:
    return DiskStore(str(path), capacity, 256, BS, fingerprint or {"model": "m"})


def _meta(i: int, persistent: bool = True) -> SlotMeta:
    return SlotMeta(_digest(i), (i,) * BS, persistent)


def test_store_round_trip_restart_and_damage(tmp_path):
    """Bytes come back equal (pending, then from the file); a restart with the same fingerprint finds
    them, another fingerprint none; a torn slot and a wrong key are misses, never bytes."""
    store = _store(tmp_path)
    payloads = {i: torch.randint(0, 256, (256,), dtype=torch.uint8) for i in range(3)}
    for i, p in payloads.items():
        store.write(i, _meta(i, persistent=i != 2), p.clone())
    first = store.stage(0, _meta(0))
    store.flush()
    assert torch.equal(store.take(first), payloads[0])
    assert store.stage(1, _meta(0)) is None  # slot 1 holds another block
    store.close()
    again = _store(tmp_path)
    assert {(r.slot, r.digest) for r in again.restored} == {(0, _digest(0)), (1, _digest(1))}  # (2: an adapter's)
    assert torch.equal(again.take(again.stage(1, _meta(1))), payloads[1])
    again.close()
    with open(tmp_path / "kv_arena.bin", "r+b") as f:  # a torn write: the payload's last bytes
        f.seek(again.slot_bytes + again.header_bytes + 200)
        f.write(b"\xff" * 56)
    torn = _store(tmp_path)
    assert torn.stage(1, _meta(1)) is None and torn.counts.corrupt == 1
    assert torch.equal(torn.take(torn.stage(0, _meta(0))), payloads[0])
    torn.close()
    other = _store(tmp_path, {"model": "another"})
    assert other.restored == [] and other.stage(0, _meta(0)) is None
    other.close()
    assert _store(tmp_path, {"model": "m"}).restored == []  # (the other fingerprint's arena replaced it)


def test_a_second_engine_on_the_same_directory_runs_without_it(tmp_path):
    first = _store(tmp_path)
    second = _store(tmp_path)
    assert first.enabled and not second.enabled and second.counts.errors == 1
    first.close()


# -- through the engine ----------------------------------------------------------------------------
def _prompts(n: int = 4, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 500) for _ in range(63)] for _ in range(n)]


def _engine(llama_dir, disk_dir=None, host_blocks: int = 4, **kw) -> LLM:
    probe = LLM(llama_dir, max_model_len=128, block_size=BS, num_gpu_blocks_override=20)
    bpb = probe.core.runner.bytes_per_block
    probe.shutdown()
    tiers = {}
    if disk_dir is not None:
        tiers = dict(kv_offload_cpu_gb=host_blocks * bpb / (1 << 30), kv_offload_disk_path=str(disk_dir),
                     kv_offload_disk_gb=64 * bpb / (1 << 30))  # fmt: skip
    return LLM(llama_dir, max_model_len=128, block_size=BS, num_gpu_blocks_override=20, admission_reserve_tokens=0,
               **tiers, **kw)  # fmt: skip


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def test_tier_round_trip_is_bit_exact(llama_dir, tmp_path):
    """A device block to host memory, from there to the file, and back to another device block:
    the same bits (FP8 KV stays FP8)."""
    for dtype in ("auto", "fp8"):
        llm = _engine(llama_dir, tmp_path / dtype, kv_cache_dtype=dtype)
        runner = llm.core.runner
        for cache in runner.kv_caches:
            cache[:, 3] = torch.randn(cache[:, 3].shape).to(cache.dtype)
        before = [c[:, 3].clone() for c in runner.kv_caches]
        meta = _meta(7)
        runner._tier_copy([(3, 1)], to_host=True)
        runner._spill_to_disk([(True, 1, 5, meta)])
        runner.host_tier_caches[0].zero_()
        store = llm.core.kv.disk_store
        store.flush()
        stage = store.stage(5, meta)
        runner._load_from_disk([(stage, 9)])
        assert all(c.dtype == runner.kv_dtype and torch.equal(c[:, 9].view(torch.uint8), b.view(torch.uint8))
                   for c, b in zip(runner.kv_caches, before))  # fmt: skip
        assert runner.kv_dtype == (torch.float8_e4m3fn if dtype == "fp8" else runner.dtype)
        llm.shutdown()


def test_evicted_prefixes_come_back_from_disk_with_equal_tokens(llama_dir, tmp_path):
    """Four 64-token prompts through a 20-block device cache and a 4-block host tier: the first
    ones' blocks go on to disk; run again, they are read back from it, and every output equals the
    engine's without tiers (which recomputes). Bytes and load latency per tier are on /metrics."""
    prompts = _prompts()
    plain = _engine(llama_dir)
    want = _run(plain, prompts + prompts)
    plain.shutdown()
    llm = _engine(llama_dir, tmp_path / "disk")
    assert _run(llm, prompts + prompts) == want
    s = llm.stats()
    assert s.kv_disk_stored_blocks > 0 and s.kv_disk_loaded_blocks > 0 and s.kv_disk_errors == 0
    assert s.kv_disk_hit_tokens == BS * s.kv_disk_loaded_blocks
    samples = {(x.name, tuple(sorted(x.labels.items()))): x.value
               for m in _EngineStateCollector(llm, "m").collect() for x in m.samples}  # fmt: skip
    disk_loaded = (("direction", "loaded"), ("model_name", "m"), ("tier", "disk"))
    assert (
        samples["llmserve:kv_tier_bytes_total", disk_loaded] == s.kv_disk_loaded_blocks * s.kv_offload_block_bytes > 0
    )
    assert (
        samples["llmserve:kv_tier_load_seconds_count", (("model_name", "m"), ("tier", "disk"))]
        == s.kv_disk_loaded_blocks
    )
    assert (
        samples["llmserve:kv_tier_load_seconds_count", (("model_name", "m"), ("tier", "cpu"))]
        == s.kv_offload_loaded_blocks
    )
    llm.shutdown()


def _fill_disk(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = _run(llm, prompts)
    llm.shutdown()  # (the writes finish: the next engine finds them)
    return outs


def test_a_restarted_engine_reuses_the_disk_tier(llama_dir, tmp_path):
    prompts = _prompts()
    first = _engine(llama_dir, tmp_path)
    outs = _fill_disk(first, prompts)
    again = _engine(llama_dir, tmp_path)
    assert _run(again, prompts[:1]) == outs[:1]
    s = again.stats()
    assert s.kv_disk_hit_tokens == (64 - 1) // BS * BS and s.prefix_cache_hits == s.kv_disk_hit_tokens
    again.shutdown()


def test_corrupt_or_foreign_blocks_are_never_loaded(llama_dir, tmp_path):
    """Every written slot's bytes damaged, or the fingerprint changed: the restarted engine loads
    nothing from the file, and its tokens equal the first engine's."""
    prompts = _prompts()
    outs = _fill_disk(_engine(llama_dir, tmp_path), prompts)
    arena = tmp_path / "kv_arena.bin"
    data = bytearray(arena.read_bytes())
    meta = json.loads((tmp_path / "kv_arena.json").read_text())
    slot = meta["slot_bytes"]
    probe = _store(tmp_path / "probe")
    header = probe.header_bytes  # (the same block size: the same header)
    probe.close()
    damaged = 0
    for start in range(0, len(data), slot):
        if data[start : start + 4] == b"LSKV":
            data[start + header + 10] ^= 0xFF  # (a byte of the block: the header still checks out)
            damaged += 1
    arena.write_bytes(bytes(data))
    assert damaged > 0
    corrupt = _engine(llama_dir, tmp_path)
    assert _run(corrupt, prompts[:1]) == outs[:1]
    s = corrupt.stats()
    assert s.kv_disk_hit_tokens == 0 and s.kv_disk_corrupt_blocks > 0
    corrupt.shutdown()
    foreign = _engine(llama_dir, tmp_path, kv_cache_dtype="fp8")  # another KV dtype: another fingerprint
    assert foreign.core.kv.disk_store.restored == []
    foreign.shutdown()


def test_a_full_disk_or_unusable_directory_recomputes(llama_dir, tmp_path):
    prompts = _prompts()
    plain = _engine(llama_dir)
    want = _run(plain, prompts + prompts)
    plain.shutdown()
    llm = _engine(llama_dir, tmp_path / "full")
    store = llm.core.kv.disk_store
    full = os.open("/dev/full", os.O_RDWR)  # every write fails with ENOSPC
    os.dup2(full, store._fd)
    os.close(full)
    assert _run(llm, prompts + prompts) == want
    s = llm.stats()
    assert s.kv_disk_errors > 0 and s.kv_disk_stored_blocks > 0
    llm.shutdown()
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    unusable = _engine(llama_dir, blocker / "kv")  # (a directory under a file cannot be made)
    assert unusable.core.kv.disk is None and unusable.stats().kv_disk_errors == 1
    assert _run(unusable, prompts + prompts) == want
    unusable.shutdown()


def test_disk_tier_refusals(llama_dir, tmp_path):
    with pytest.raises(ConfigError, match="kv_offload_cpu_gb"):
        LLM(llama_dir, max_model_len=64, kv_offload_disk_path=str(tmp_path), kv_offload_disk_gb=0.01)
    with pytest.raises(ConfigError, match="both"):
        LLM(llama_dir, max_model_len=64, kv_offload_cpu_gb=0.001, kv_offload_disk_gb=0.01)
    with pytest.raises(ConfigError, match="kv_offload_disk_gb"):
        LLM(llama_dir, max_model_len=64, kv_offload_cpu_gb=0.001, kv_offload_disk_path=str(tmp_path),
            kv_offload_disk_gb=-1)  # fmt: skip


def test_disk_blocks_are_told_as_kv_events(llama_dir, tmp_path):
    """A block the host tier hands down is BlockStored with medium DISK (the hash a router computes
    from the prompt), and its load back is BlockStored on the GPU again."""
    import zmq
    from test_kv_events import BlockRemoved, BlockStored, _port, _receive

    from llmserve.engine.kv_events import block_hashes

    pub = _port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{pub}", "topic": "kv"}
    llm = _engine(llama_dir, tmp_path, kv_events_config=json.dumps(config))
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.3)  # (a PUB drops what it sends before the subscription arrives)
    try:
        prompts = _prompts()
        _run(llm, prompts)
        first = _receive(sub)
        _run(llm, prompts[:1])
        again = _receive(sub)
    finally:
        context.destroy(linger=0)
        llm.shutdown()
    want = set(block_hashes(prompts[0], BS))
    on_disk = {h for _, b in first for e in b.events if isinstance(e, BlockStored) and e.medium == "DISK"
               for h in e.block_hashes}  # fmt: skip
    off_host = {h for _, b in first for e in b.events if isinstance(e, BlockRemoved) and e.medium == "CPU"
                for h in e.block_hashes}  # fmt: skip
    back = {h for _, b in again for e in b.events if isinstance(e, BlockStored) and e.medium == "GPU"
            for h in e.block_hashes}  # fmt: skip
    assert want & on_disk and want & on_disk <= off_host  # (each went down from the host tier)
    assert want & on_disk & back
