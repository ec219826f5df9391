"""KV groups (engine/kv_layout.py) and the block manager over them: sliding-window layers hold
only their window's blocks, every block comes back, prefix hits and swaps keep the layout."""

from __future__ import annotations

import pytest

from llmserve.engine.block_pool import BlockKey
from llmserve.engine.kv_cache_manager import KVCacheManager
from llmserve.engine.kv_layout import NULL_BLOCK, plan_layout, single_group
from llmserve.engine.request import EngineCoreRequest, Request
from llmserve.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

BS = 4
W = 8  # the sliding window: two blocks


def gemma_windows(num_layers: int, window: int = 512, pattern: int = 6) -> list[int | None]:
    return [None if (i + 1) % pattern == 0 else window for i in range(num_layers)]


def test_plan_layout_shapes():
    llama = plan_layout([None] * 32, [1024] * 32)
    assert llama.simple and llama.num_groups == 1 and llama.layers_per_group == 32
    assert llama.layer_slot == tuple(range(32))
    mistral = plan_layout([4096] * 32, [1024] * 32)  # one sliding group: every layer releases
    assert mistral.num_groups == 1 and mistral.sliding and not mistral.simple
    # Gemma 3 270M: 15 local layers, 3 global: six groups of three, no slot wasted
    g270 = plan_layout(gemma_windows(18), [256] * 18)
    assert g270.layers_per_group == 3 and g270.windows.count(None) == 1 and g270.num_groups == 6
    # Gemma 3 1B: 22 local, 4 global: groups of four (two slots of 28 empty) rather than 13 of two
    g1b = plan_layout(gemma_windows(26), [256] * 26)
    assert g1b.layers_per_group == 4 and g1b.num_groups == 7
    for layout in (g270, g1b):  # every layer has a slot; no two layers of a group share one
        seen = {(g, s) for g, s in zip(layout.layer_group, layout.layer_slot)}
        assert len(seen) == len(layout.layer_group)
        assert all(s < layout.layers_per_group for s in layout.layer_slot)
        windows = gemma_windows(len(layout.layer_group))
        assert all(layout.windows[layout.layer_group[i]] == w for i, w in enumerate(windows))
    # unequal KV widths cannot share tensors: one group that keeps every block
    assert plan_layout([None, 512], [256, 512]).simple


def _request(rid: str, n: int, start: int = 0) -> Request:
    return Request(EngineCoreRequest(request_id=rid, prompt_token_ids=list(range(start, start + n)),
                                     sampling_params=SamplingParams(), max_tokens=64, eos_token_ids=(),
                                     priority=0, arrival_time=0.0))  # fmt: skip


def _manager(num_blocks: int = 64, caching: bool = True, cpu_blocks: int = 0) -> KVCacheManager:
    layout = plan_layout([W, W, None, W, W, None], [8] * 6)  # two groups of two local, one of two global
    return KVCacheManager(num_blocks, BS, caching, cpu_blocks, layout)


def _held(kv: KVCacheManager, req: Request) -> list[int]:
    """Blocks held per group."""
    blocks = kv.block_table(req.request_id)
    return [sum(b != NULL_BLOCK for b in blocks[g :: kv.groups]) for g in range(kv.groups)]


def _run(kv: KVCacheManager, req: Request, chunk: int) -> list[list[int]]:
    """Compute the prompt in chunks, then 8 decode tokens; the held blocks after each step."""
    held = []
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert kv.allocate_slots(req, n)
        req.num_computed_tokens += n
        kv.cache_full_blocks(req)
        held.append(_held(kv, req))
    for token in range(8):
        req.all_token_ids.append(1000 + token)
        assert kv.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        held.append(_held(kv, req))
    return held


def test_sliding_groups_hold_their_window():
    kv = _manager()
    assert kv.groups == 3 and kv.layout.windows.count(None) == 1
    req = _request("a", 3 * W * BS)  # a prompt of 3 x the window... in tokens: 96, 24 blocks
    held = _run(kv, req, chunk=BS)
    full = kv.layout.windows.index(None)
    window_blocks = -(-W // BS) + 1  # the window's keys span at most this many blocks
    for step in held:
        assert all(h <= window_blocks for g, h in enumerate(step) if g != full)
    assert held[-1][full] == -(-req.num_tokens // BS)  # the global layers keep every block
    used = kv.pool.num_used
    assert used == sum(held[-1])
    kv.free(req)
    assert kv.pool.num_used == 0 and kv.pool.num_free == kv.pool.num_usable


def test_long_chunk_takes_every_block_then_releases():
    kv = _manager()
    req = _request("a", 40)
    assert kv.allocate_slots(req, 40)  # one step writes all 40 keys in every layer
    assert _held(kv, req) == [10, 10, 10]
    req.num_computed_tokens = 40
    req.all_token_ids.append(7)
    assert kv.allocate_slots(req, 1)  # the next step reads keys 33.. only in the local layers
    full = kv.layout.windows.index(None)
    assert [h for g, h in enumerate(_held(kv, req)) if g != full] == [3, 3]
    kv.free(req)
    assert kv.pool.num_used == 0


def test_prefix_hit_needs_only_the_last_window():
    kv = _manager()
    first = _request("a", 48)
    _run(kv, first, chunk=8)
    kv.free(first)
    second = _request("b", 48)
    hit = kv.get_computed_blocks(second)
    n = kv.num_hit_blocks(hit)
    assert n == (48 - 1) // BS  # every full block but the last token's
    full = kv.layout.windows.index(None)
    for g in range(kv.groups):
        entries = hit[g :: kv.groups]
        if g == full:
            assert NULL_BLOCK not in entries
        else:  # only the blocks the next query's window reads
            first_needed = kv.layout.first_needed(g, n * BS, BS)
            assert entries[:first_needed] == [NULL_BLOCK] * first_needed
            assert NULL_BLOCK not in entries[first_needed:]
    assert kv.allocate_slots(second, 48 - n * BS, hit)
    second.num_computed_tokens = 48
    assert all(h <= -(-W // BS) + 1 for g, h in enumerate(_held(kv, second)) if g != full)
    kv.free(second)
    assert kv.pool.num_used == 0


def test_prefix_hit_survives_evicted_early_local_blocks():
    """Local blocks released behind the window go back to the pool first; when they are taken
    by others, a later request still hits the prefix through the last window's blocks."""
    kv = _manager(num_blocks=40)
    first = _request("a", 48)
    _run(kv, first, chunk=8)
    full = kv.layout.windows.index(None)
    early_local = [b for i, b in enumerate(kv.block_table("a")[: 4 * kv.groups]) if i % kv.groups != full]
    kv.free(first)
    other = _request("x", 4 * BS, start=5000)  # takes free blocks, the released local ones among them
    assert kv.allocate_slots(other, 4 * BS)
    assert set(early_local) & set(kv.block_table("x")) or True  # (which blocks go first is the pool's)
    second = _request("b", 48)
    hit = kv.get_computed_blocks(second)
    assert kv.num_hit_blocks(hit) > 0


def test_swap_keeps_released_entries():
    kv = _manager(cpu_blocks=64)
    req = _request("a", 64)
    _run(kv, req, chunk=8)
    before = list(kv.block_table("a"))
    held_before = _held(kv, req)
    mapping = kv.swap_out(req)
    assert mapping is not None and len(mapping) == sum(held_before)
    assert kv.pool.num_used == 0
    assert kv.swap_in_blocks_needed(req, 1) >= sum(held_before)
    back = kv.swap_in(req)
    assert len(back) == len(mapping)
    after = kv.block_table("a")
    assert [b == NULL_BLOCK for b in after] == [b == NULL_BLOCK for b in before]
    assert _held(kv, req) == held_before
    kv.free(req)
    assert kv.pool.num_used == 0 and kv.swap_pool.num_free == 64


def test_null_block_is_never_handed_out():
    kv = _manager(num_blocks=10)
    assert kv.pool.num_free == 9
    taken = kv.pool.allocate(9)
    assert NULL_BLOCK not in taken
    with pytest.raises(RuntimeError):
        kv.pool.allocate(1)


def test_single_group_layout_is_the_plain_cache():
    kv = KVCacheManager(16, BS, True, 0, single_group(4))
    req = _request("a", 20)
    assert kv.allocate_slots(req, 20)
    assert kv.block_table("a") == list(range(5))  # block 0 is an ordinary block
    kv.free(req)
    assert kv.pool.num_used == 0


def test_group_keys_do_not_collide():
    key = BlockKey(None, (1, 2, 3, 4), None)
    kv = _manager()
    assert len({kv._group_key(key, g) for g in range(kv.groups)}) == kv.groups


# -- the engine: a prompt of 3 x the window on the tiny Gemma 3 (window 16, five local layers) ------
def test_engine_holds_only_the_window_in_local_layers(model_dirs):
    """A prompt of 3 x the window in chunks: after each step the local layers' groups hold at most
    the window's blocks plus the chunk's; while decoding, the window's; the tokens equal
    transformers'; the pool's use is the global layer's blocks plus the windows'."""
    from conftest import hf_greedy

    from llmserve import LLM, SamplingParams

    path = model_dirs["gemma3"]
    window, bs, chunk = 16, 4, 8
    llm = LLM(path, max_model_len=128, block_size=bs, enable_chunked_prefill=True, max_num_batched_tokens=chunk)
    kv = llm.core.kv
    layout = kv.layout
    assert layout.num_groups == 6 and layout.windows.count(window) == 5  # one layer a group
    held_after: list[list[int]] = []
    original = kv.allocate_slots

    def watch(req, *args, **kwargs):
        ok = original(req, *args, **kwargs)
        if ok:
            blocks = kv.block_table(req.request_id)
            held_after.append([sum(b != NULL_BLOCK for b in blocks[g :: kv.groups]) for g in range(kv.groups)])
        return ok

    kv.allocate_slots = watch
    prompt = [1] + [(7 * i) % 400 + 3 for i in range(3 * window - 1)]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(path, [prompt], 12)[0]
    full = layout.windows.index(None)
    window_blocks = -(-window // bs) + 1
    for step in held_after:  # a chunk's step reads the window before it and writes its own keys
        assert all(h <= window_blocks + chunk // bs for g, h in enumerate(step) if g != full)
    decode = held_after[-1]
    assert all(h <= window_blocks for g, h in enumerate(decode) if g != full)
    total = 3 * window + 12 - 1  # tokens in the cache at the last step
    assert decode[full] == -(-total // bs)
    # in a plain cache every layer would hold every block: the local layers' share saved
    plain = kv.groups * decode[full]
    assert sum(decode) <= plain * 0.5


def test_the_prompt_s_window_outlives_older_free_blocks():
    """Blocks of the prompt's last window, released while the request decoded, are refreshed when
    it ends: taking every free block but those a repeat of the prompt needs keeps its whole hit."""
    kv = _manager(num_blocks=80)
    first = _request("a", 48)
    _run(kv, first, chunk=8)  # 8 decode tokens: the window before the prompt's end slides on
    kv.free(first)
    n = (48 - 1) // BS
    needed = sum(n - kv.layout.first_needed(g, n * BS, BS) for g in range(kv.groups))
    kv.pool.allocate(kv.pool.num_free - needed)  # evicts the least recently used cached blocks
    again = _request("b", 48)
    assert kv.num_hit_blocks(kv.get_computed_blocks(again)) == n
