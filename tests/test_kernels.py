"""The Triton kernels against their PyTorch references, on CPU under the Triton interpreter.

Shapes are tiny on purpose: the interpreter runs every program in Python. What is covered:
mixed varlen batches (decodes, fresh prefills, chunks that start after cached tokens, an
empty sequence, a padding token with slot -1), GQA ratios 1/2/4, block sizes 4/8/16,
padded block tables, head dims 16/24/32, the split-KV path forced on (including splits in
which some rows see no key), strided q/k views, float32 (tight) and float16; bfloat16 for
the elementwise kernels. Sliding windows (smaller than, equal to and larger than the context,
not multiples of the block size) in every attention path, and that a window bounds the keys read.
"""

from __future__ import annotations

import math
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton or llmserve.kernels is imported

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

if not isinstance(triton.language.standard.cdiv, InterpretedFunction):
    # triton's own @jit helpers (reductions...) were built for a GPU: the interpreter cannot
    # call them, and re-importing triton in-process is not possible
    pytest.skip(
        "triton was imported before TRITON_INTERPRET=1 was set; run tests/test_kernels.py in its own process",
        allow_module_level=True,
    )

import llmserve.kernels as K  # noqa: E402
from llmserve.kernels import activation, cache_write, norm, paged_attention, rotary  # noqa: E402
from llmserve.model.arch import RopeConfig  # noqa: E402
from llmserve.model.attention import (  # noqa: E402
    AttentionMetadata,
    reference_paged_attention,
    write_kv_cache,
)
from llmserve.model.layers import RMSNorm, RotaryEmbedding  # noqa: E402
from llmserve.model.layers import silu_and_mul as ref_silu_and_mul  # noqa: E402

pytestmark = pytest.mark.unit

TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


# -- batch construction ------------------------------------------------------------------


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    pad_blocks: int = 2,
    skip_tokens: tuple[int, ...] = (),
    strided_qkv: bool = False,
):
    """A flat varlen batch over a randomly filled cache with shuffled, padded block tables.

    The cache starts as random numbers (the "cached prefix" of every sequence); tokens listed
    in `skip_tokens` get slot -1 (their K/V are not written, as for padding).
    """
    g = torch.Generator().manual_seed(seed)
    num_tokens = sum(query_lens)
    blocks_needed = sum(-(-s // block_size) for s in seq_lens)
    num_blocks = blocks_needed + 3
    if strided_qkv:  # q, k, v as views of one fused projection output, like the model
        qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
        qkv = qkv.to(dtype)
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q = q.view(num_tokens, num_heads, head_dim)
        k = k.view(num_tokens, num_kv_heads, head_dim)
        v = v.view(num_tokens, num_kv_heads, head_dim)
    else:
        q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
        k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    kv_cache = kv_cache.to(dtype)
    max_blocks = max(-(-s // block_size) for s in seq_lens) + pad_blocks
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # block 0: padding
    slots = []
    for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        n = -(-s_len // block_size)
        block_tables[i, :n] = torch.tensor(free[:n], dtype=torch.int32)
        free = free[n:]
        for p in range(s_len - q_len, s_len):
            slots.append(int(block_tables[i, p // block_size]) * block_size + p % block_size)
    for t in skip_tokens:
        slots[t] = -1
    qsl = [0]
    for q_len in query_lens:
        qsl.append(qsl[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return q, k, v, kv_cache, meta


def check_attention(q, k, v, kv_cache, meta, scale, *, num_splits=None, config=None, kv_scales=(1.0, 1.0),
                    window=None):  # fmt: skip
    ref_cache = kv_cache.clone()
    ref = reference_paged_attention(q, k, v, ref_cache, meta, scale, kv_scales=kv_scales, window=window)
    out = K.triton_paged_attention(
        q, k, v, kv_cache, meta, scale, num_splits=num_splits, config=config, kv_scales=kv_scales, window=window
    )
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(kv_cache, ref_cache, atol=0, rtol=0)  # same K/V written
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[q.dtype])
    return out


# A mixed batch: decode, fresh prefill, decode, chunk after 13 cached tokens, empty sequence,
# long-ish decode, chunk after a block-aligned prefix, and a padding-like decode (slot -1).
MIXED_QLENS = [1, 11, 1, 9, 0, 1, 6, 1]
MIXED_SEQLENS = [7, 11, 30, 22, 5, 41, 22, 3]
MIXED_SKIP = (sum(MIXED_QLENS) - 1,)

ATTN_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits)
    pytest.param(4, 4, 32, 16, torch.float32, 1, id="gqa1-bs16-d32-fp32"),
    pytest.param(4, 2, 16, 8, torch.float32, 3, id="gqa2-bs8-d16-fp32-split3"),
    pytest.param(4, 1, 16, 4, torch.float32, 1, id="gqa4-bs4-d16-fp32"),
    pytest.param(4, 1, 24, 8, torch.float32, 4, id="gqa4-bs8-d24-fp32-split4"),
    pytest.param(4, 1, 32, 16, torch.float16, 2, id="gqa4-bs16-d32-fp16-split2"),
    pytest.param(4, 2, 16, 4, torch.float16, 1, id="gqa2-bs4-d16-fp16"),
]
# No bfloat16 attention case here: the Triton interpreter's bf16 `tl.dot` is wrong (it
# multiplies raw bit patterns) and its fp32->bf16 cast truncates. bf16 attention is
# checked against the reference on the GPU by scripts/gpu/bench_kernels.py.


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype,num_splits", ATTN_CASES)
def test_paged_attention_mixed_batch(num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits):
    batch = make_batch(
        MIXED_QLENS, MIXED_SEQLENS, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=dtype, skip_tokens=MIXED_SKIP,
        seed=num_kv_heads * 100 + block_size,
    )  # fmt: skip
    check_attention(*batch, head_dim**-0.5, num_splits=num_splits)


def test_sampled_rows_attend_alone_after_every_row_is_written():
    """The last layer's attention of the sampling rows alone (`SampledRows`): every row's K/V
    written by the batch's slot mapping, then one one-token query a sampling sequence over the
    cache (q/k/v strided, as the model's). Equal to those rows of the whole batch's attention,
    and the same cache."""
    qlens, seqlens = [1, 11, 1, 9, 6, 1], [7, 11, 30, 22, 22, 41]
    q, k, v, kv_cache, meta = make_batch(qlens, seqlens, num_heads=4, num_kv_heads=1, head_dim=16, block_size=8,
                                         dtype=torch.float32, strided_qkv=True, seed=21)  # fmt: skip
    ref_cache = kv_cache.clone()
    ref = reference_paged_attention(q, k, v, ref_cache, meta, 0.3)
    samples = [0, 1, 2, 4, 5]  # the chunk after 13 cached tokens (sequence 3) does not sample
    ends = meta.query_start_loc[1:].tolist()
    rows = torch.tensor([ends[i] - 1 for i in samples])
    keep = AttentionMetadata(
        slot_mapping=meta.slot_mapping, query_start_loc=torch.arange(len(samples) + 1, dtype=torch.int32),
        seq_lens=meta.seq_lens[samples], block_tables=meta.block_tables[samples], max_query_len=1,
        max_seq_len=max(seqlens[i] for i in samples), num_decode_seqs=len(samples),
    )  # fmt: skip
    out = K.triton_paged_attention(q[rows], k, v, kv_cache, keep, 0.3)
    torch.testing.assert_close(kv_cache, ref_cache, atol=0, rtol=0)
    torch.testing.assert_close(out, ref[rows], **TOL[torch.float32])
    none = AttentionMetadata(meta.slot_mapping, torch.zeros(1, dtype=torch.int32), meta.seq_lens[:0],
                             meta.block_tables[:0], 1, 0, 0)  # fmt: skip
    kv_cache.zero_()
    assert K.triton_paged_attention(q[:0], k, v, kv_cache, none, 0.3).shape[0] == 0
    written = meta.slot_mapping
    flat = kv_cache.view(2, -1, 1, 16)
    torch.testing.assert_close(flat[0, written], k.contiguous(), atol=0, rtol=0)  # no row samples: still written


def test_paged_attention_multi_tile_prefill_strided_qkv():
    """Chunks longer than one tile (binary search over tiles), q/k/v as strided views."""
    cfg = K.AttnLaunchConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)  # 4 tokens
    batch = make_batch(
        [1, 10, 7], [9, 10, 25], num_heads=4, num_kv_heads=1, head_dim=16, block_size=8,
        dtype=torch.float32, strided_qkv=True, seed=7,
    )  # fmt: skip
    assert not batch[0].is_contiguous()
    check_attention(*batch, 0.3, config=cfg)
    batch = make_batch(
        [1, 10, 7], [9, 10, 25], num_heads=4, num_kv_heads=1, head_dim=16, block_size=8,
        dtype=torch.float32, strided_qkv=True, seed=7,
    )  # fmt: skip
    check_attention(*batch, 0.3, config=cfg, num_splits=2)


@pytest.mark.parametrize("num_splits", [1, 4, None])
def test_paged_attention_decode_batch(num_splits):
    """Pure decode (one tile per sequence); None lets the heuristic split (tiny batch)."""
    batch = make_batch(
        [1, 1, 1], [40, 3, 17], num_heads=8, num_kv_heads=2, head_dim=16, block_size=8,
        dtype=torch.float32, seed=3,
    )  # fmt: skip
    if num_splits is None:  # the heuristic must pick a split for 3 seqs x 2 heads, len 40
        assert K.choose_num_splits(3, 2, 40, min_tokens_per_split=8) > 1
    check_attention(*batch, 0.25, num_splits=num_splits)


def test_split_kv_changes_the_launch_but_not_the_result():
    """Split and unsplit runs agree with each other (and the split really ran: scratch used)."""
    batch = make_batch(
        [1, 5], [33, 20], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
        dtype=torch.float32, seed=11,
    )  # fmt: skip
    q, k, v, cache, meta = batch
    K.write_kv(k, v, cache, meta.slot_mapping)
    one = K.paged_attention_forward(q, cache, meta, 0.25, num_splits=1)
    calls = []
    real_reduce = paged_attention._reduce_splits_kernel
    orig_getitem = type(real_reduce).__getitem__

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return orig_getitem(real_reduce, grid)

    paged_attention._reduce_splits_kernel = Spy()
    try:
        many = K.paged_attention_forward(q, cache, meta, 0.25, num_splits=5)
    finally:
        paged_attention._reduce_splits_kernel = real_reduce
    assert len(calls) == 1
    torch.testing.assert_close(many, one, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [None, 3])
def test_mixed_batch_led_by_decodes_runs_as_two_launches(num_splits, monkeypatch):
    """Decodes at the front of a mixed batch run with the decode tiles, the prefill chunks
    after them with the prefill tiles (two launches, the second from a token offset, its
    split scratch rows counted from there): the same output as one launch and as the
    reference, and the padding row past the last sequence is left alone."""
    qlens, slens = [1, 1, 1, 9, 0, 6], [30, 7, 41, 22, 5, 6]
    q, k, v, cache, meta = make_batch(qlens, slens, num_heads=4, num_kv_heads=1, head_dim=16, block_size=8,
                                      dtype=torch.float32, seed=21)  # fmt: skip
    q = torch.cat([q, torch.zeros(1, 4, 16)])  # one padding row, as in a padded step
    meta.num_decode_seqs = 3
    K.write_kv(k, v, cache, meta.slot_mapping)
    ref = reference_paged_attention(q[:-1], k, v, cache.clone(), meta, 0.3)
    launches = []
    original = paged_attention._launch
    monkeypatch.setattr(paged_attention, "_launch", lambda *a, **kw: launches.append(a[8]) or original(*a, **kw))
    one = K.paged_attention_forward(q, cache, meta, 0.3, num_splits=num_splits, split_decodes=False)
    sentinel = torch.full_like(q, 7.0)
    two = K.paged_attention_forward(q, cache, meta, 0.3, num_splits=num_splits, split_decodes=True,
                                    out=sentinel)  # fmt: skip
    assert launches == [sum(qlens) + 1, 3, sum(qlens) + 1 - 3]  # token rows: all; decodes; the rest
    torch.testing.assert_close(two[:-1], ref, **TOL[torch.float32])
    torch.testing.assert_close(two[:-1], one[:-1], atol=1e-5, rtol=1e-5)
    assert (two[-1] == 7.0).all()


def test_decodes_split_off_only_from_the_threshold(monkeypatch):
    q, k, v, cache, meta = make_batch([1, 1, 5], [9, 12, 5], num_heads=4, num_kv_heads=2, head_dim=16,
                                      block_size=4, dtype=torch.float32, seed=5)  # fmt: skip
    K.write_kv(k, v, cache, meta.slot_mapping)
    launches = []
    original = paged_attention._launch
    monkeypatch.setattr(paged_attention, "_launch", lambda *a, **kw: launches.append(a[8]) or original(*a, **kw))
    meta.num_decode_seqs = 2
    monkeypatch.setattr(paged_attention, "MIN_DECODES_TO_SPLIT", 3)
    K.paged_attention_forward(q, cache, meta, 0.3)
    assert launches == [7]
    monkeypatch.setattr(paged_attention, "MIN_DECODES_TO_SPLIT", 2)
    K.paged_attention_forward(q, cache, meta, 0.3)
    assert launches == [7, 2, 5]
    K.paged_attention_forward(q, cache, meta, 0.3, num_splits=1)  # a forced launch shape: one launch
    assert launches == [7, 2, 5, 7]


def test_decodes_beside_long_prompts_take_their_own_launch(monkeypatch):
    """However few, decodes beside prompts of LONG_PREFILL_TOKENS or more on average run apart,
    so the prompts get the long tiles; the same result as one launch. Short prompts beside the
    same decodes keep one launch (fewer decodes than MIN_DECODES_TO_SPLIT)."""
    monkeypatch.setattr(paged_attention, "LONG_PREFILL_TOKENS", 12)
    assert paged_attention.long_prefill_beside(2, 4, 2 + 24) and not paged_attention.long_prefill_beside(2, 4, 2 + 23)
    assert not paged_attention.long_prefill_beside(0, 2, 40) and not paged_attention.long_prefill_beside(3, 3, 3)
    q, k, v, cache, meta = make_batch([1, 1, 14, 12], [9, 30, 14, 20], num_heads=4, num_kv_heads=2, head_dim=16,
                                      block_size=4, dtype=torch.float32, seed=8)  # fmt: skip
    meta.num_decode_seqs = 2
    K.write_kv(k, v, cache, meta.slot_mapping)
    launches = []
    original = paged_attention._launch
    monkeypatch.setattr(paged_attention, "_launch", lambda *a, **kw: launches.append(a[8]) or original(*a, **kw))
    apart = K.paged_attention_forward(q, cache, meta, 0.3)
    assert launches == [2, 26]
    together = K.paged_attention_forward(q, cache, meta, 0.3, split_decodes=False)
    torch.testing.assert_close(apart, together, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(paged_attention, "LONG_PREFILL_TOKENS", 14)
    K.paged_attention_forward(q, cache, meta, 0.3)
    assert launches == [2, 26, 28, 28]


def test_one_fresh_long_sequence_takes_sdpa_and_matches_the_reference(monkeypatch):
    """A prompt's first chunk alone in its step (no cached prefix) is attended by torch's SDPA
    over its own q/k/v (cuDNN on a GPU, the math backend here): same K/V written, same
    output as the reference; a chunk after cached tokens, or two sequences, keep the kernel."""
    monkeypatch.setattr(paged_attention, "SDPA_PREFILL_TOKENS", 16)
    calls = []
    original = paged_attention.sdpa_prefill
    # (the arguments counted: alone in its step, SDPA's own output is returned, with no `out` to copy into)
    monkeypatch.setattr(
        paged_attention, "sdpa_prefill", lambda *a, **kw: calls.append(len(a) + len(kw)) or original(*a, **kw)
    )
    for strided in (False, True):
        q, k, v, cache, meta = make_batch([40], [40], num_heads=8, num_kv_heads=2, head_dim=32, block_size=8,
                                          dtype=torch.float32, strided_qkv=strided)  # fmt: skip
        assert paged_attention.fresh_single_prefill(meta)
        check_attention(q, k, v, cache, meta, 32**-0.5)
    assert calls == [4, 4]
    # padded to a shared length (as on a GPU, where cuDNN plans per shape): still exact
    q, k, v, cache, meta = make_batch([40], [40], num_heads=8, num_kv_heads=2, head_dim=32, block_size=8,
                                      dtype=torch.float32)  # fmt: skip
    ref = reference_paged_attention(q, k, v, cache.clone(), meta, 32**-0.5)
    torch.testing.assert_close(original(q, k, v, 32**-0.5, pad_to=53), ref, **TOL[torch.float32])
    for qlens, slens in (([40], [52]), ([20, 20], [20, 20]), ([12], [12])):  # cached prefix; two; short
        q, k, v, cache, meta = make_batch(qlens, slens, num_heads=8, num_kv_heads=2, head_dim=32, block_size=8,
                                          dtype=torch.float32)  # fmt: skip
        assert not paged_attention.fresh_single_prefill(meta)
        check_attention(q, k, v, cache, meta, 32**-0.5)
    assert len(calls) == 2


def test_fresh_long_prompts_of_a_mixed_batch_take_sdpa_and_the_rest_the_kernel(monkeypatch):
    """Several fresh prompts in one step (AttentionMetadata.fresh_seqs, as the input builder lists
    them): each long one by SDPA, the sequences between them by the kernel in runs (the leading
    decodes apart), every row as the reference; a forced launch shape keeps the kernel alone."""
    monkeypatch.setattr(paged_attention, "SDPA_PREFILL_TOKENS", 16)
    qlens, slens = [1, 1, 40, 20, 30, 6, 24], [9, 30, 40, 52, 30, 6, 24]
    fresh = ((2, 2, 40), (4, 62, 30), (5, 92, 6), (6, 98, 24))  # seq 3 has a cached prefix: not fresh
    sdpa_rows, launches = [], []
    original_sdpa, original_launch = paged_attention.sdpa_prefill, paged_attention._launch
    monkeypatch.setattr(paged_attention, "sdpa_prefill",
                        lambda q, *a, **kw: sdpa_rows.append(q.shape[0]) or original_sdpa(q, *a, **kw))  # fmt: skip
    monkeypatch.setattr(
        paged_attention, "_launch", lambda *a, **kw: launches.append(a[6:9]) or original_launch(*a, **kw)
    )
    for dtype in (torch.float32, torch.float16):  # (bf16: the interpreter's dot is wrong, see ATTN_CASES)
        q, k, v, cache, meta = make_batch(qlens, slens, num_heads=8, num_kv_heads=2, head_dim=32, block_size=8,
                                          dtype=dtype, seed=3)  # fmt: skip
        meta.num_decode_seqs, meta.fresh_seqs = 2, fresh
        check_attention(q, k, v, cache, meta, 32**-0.5)
    # SDPA: the prompts of 40, 30 and 24 tokens; the kernel: the 2 decodes, seq 3 (20 rows), seq 5 (6)
    assert sdpa_rows == [40, 30, 24] * 2 and launches == [(0, 2, 2), (3, 1, 20), (5, 1, 6)] * 2
    sdpa_rows.clear()
    launches.clear()
    q, k, v, cache, meta = make_batch(qlens, slens, num_heads=8, num_kv_heads=2, head_dim=32, block_size=8,
                                      dtype=torch.float32, seed=3)  # fmt: skip
    meta.num_decode_seqs, meta.fresh_seqs = 2, fresh
    check_attention(q, k, v, cache, meta, 32**-0.5, num_splits=1)
    assert sdpa_rows == [] and len(launches) == 1
    # none long enough: the kernel over the whole batch, as without the list
    monkeypatch.setattr(paged_attention, "SDPA_PREFILL_TOKENS", 41)
    launches.clear()
    check_attention(q, k, v, cache.clone(), meta, 32**-0.5)
    assert sdpa_rows == [] and launches[0][:2] == (0, 7)


def test_fresh_prefill_tiles_fit_shared_memory_for_every_head_size():
    """The tiles `launch_config` picks stay under the shared-memory budget for 64-, 128- and
    256-wide heads in 16 and 32 bits (Gemma 3's 256 in bf16 asked for 256 KiB on an H100 and did
    not launch), and Llama's 128 in 16 bits keeps the swept tiles. Warm-up compiles each shape once."""
    from llmserve.kernels.fresh_prefill import SMEM_BUDGET, launch_config, tile_bytes, warmup_fresh_prefill

    for head_dim in (64, 128, 256):
        for itemsize in (2, 4):
            for n in (100, 1000, 8000):
                assert tile_bytes(launch_config(n, head_dim, itemsize), head_dim, itemsize) <= SMEM_BUDGET
    assert [launch_config(n) for n in (600, 1100, 1600)] == [(64, 32, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3)]
    assert launch_config(1600, 256, 2) != (128, 64, 8, 3)
    units = []
    assert warmup_fresh_prefill(1, 1, 256, torch.float32, torch.device("cpu"), units.append) == len(units) == 1


def test_the_fresh_prefill_kernel_matches_causal_sdpa_per_prompt():
    """`fresh_prefill_attention` against each prompt's causal SDPA (the math backend) over its own
    rows: strided q/k/v views of one fused projection, lengths on and off the tiles (the last
    tile partly past the end; the first tile alone), GQA of 4 heads a group; rows of the other
    sequences left as they were."""
    from llmserve.kernels.fresh_prefill import fresh_prefill_attention, launch_config, warmup_fresh_prefill

    assert launch_config(512) != launch_config(1024) != launch_config(2048)
    assert warmup_fresh_prefill(1, 1, 16, torch.float32, torch.device("cpu")) == 3  # each tile shape once
    units = []
    assert warmup_fresh_prefill(1, 1, 16, torch.float32, torch.device("cpu"), units.append) == len(units) == 3
    hq, hkv, d = 8, 2, 32
    lens = [70, 5, 64, 129, 1]  # the third sequence (64) is not listed: a decode or a cached chunk there
    rows = sum(lens)
    for dtype in (torch.float32, torch.float16):
        torch.manual_seed(4)
        qkv = torch.randn(rows, (hq + 2 * hkv) * d, dtype=dtype)
        q, k, v = (t.view(rows, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], -1))
        starts = [sum(lens[:i]) for i in range(len(lens))]
        seqs = tuple((starts[i], lens[i]) for i in (0, 1, 3, 4))
        out = torch.full_like(q, 7.0)
        fresh_prefill_attention(q, k, v, seqs, d**-0.5, out)
        for first, n in seqs:
            qs, ks, vs = (t[first : first + n].transpose(0, 1)[None].float() for t in (q, k, v))
            ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=d**-0.5, enable_gqa=True)
            torch.testing.assert_close(out[first : first + n].float(), ref[0].transpose(0, 1), **TOL[dtype])
        assert (out[starts[2] : starts[2] + 64] == 7.0).all()


def test_fresh_prompts_below_the_sdpa_length_take_the_fresh_kernel(monkeypatch):
    """A mixed step: fresh prompts from FRESH_KERNEL_TOKENS up by one launch of the fresh kernel,
    from SDPA_PREFILL_TOKENS up by SDPA, shorter ones, decodes and a cached chunk by the paged
    kernel in runs; every row and the written K/V as the reference."""
    from llmserve.kernels import fresh_prefill

    monkeypatch.setattr(paged_attention, "SDPA_PREFILL_TOKENS", 32)
    monkeypatch.setattr(paged_attention, "FRESH_KERNEL_TOKENS", 8)
    qlens, slens = [1, 1, 40, 20, 30, 6, 24], [9, 30, 40, 52, 30, 6, 24]
    fresh = ((2, 2, 40), (4, 62, 30), (5, 92, 6), (6, 98, 24))  # seq 3 has a cached prefix: not fresh
    kernel_seqs, sdpa_rows, launches = [], [], []
    original_fresh, original_sdpa, original_launch = (paged_attention.fresh_prefill_attention,
                                                      paged_attention.sdpa_prefill, paged_attention._launch)  # fmt: skip
    monkeypatch.setattr(paged_attention, "fresh_prefill_attention", lambda q, k, v, seqs, *a, **kw:
                        kernel_seqs.append(seqs) or original_fresh(q, k, v, seqs, *a, **kw))  # fmt: skip
    monkeypatch.setattr(paged_attention, "sdpa_prefill",
                        lambda q, *a, **kw: sdpa_rows.append(q.shape[0]) or original_sdpa(q, *a, **kw))  # fmt: skip
    monkeypatch.setattr(
        paged_attention, "_launch", lambda *a, **kw: launches.append(a[6:9]) or original_launch(*a, **kw)
    )
    for dtype in (torch.float32, torch.float16):
        q, k, v, cache, meta = make_batch(qlens, slens, num_heads=8, num_kv_heads=2, head_dim=32, block_size=8,
                                          dtype=dtype, seed=3, strided_qkv=True)  # fmt: skip
        meta.num_decode_seqs, meta.fresh_seqs = 2, fresh
        check_attention(q, k, v, cache, meta, 32**-0.5)
    # fresh kernel: the prompts of 30 and 24 tokens; SDPA: 40; the paged kernel: 2 decodes, seq 3, seq 5 (6 < 8)
    assert kernel_seqs == [((62, 30), (98, 24))] * 2 and sdpa_rows == [40] * 2
    assert launches == [(0, 2, 2), (3, 1, 20), (5, 1, 6)] * 2
    # alone in its step, a fresh prompt of the fresh kernel's lengths
    q, k, v, cache, meta = make_batch([24], [24], num_heads=8, num_kv_heads=2, head_dim=32, block_size=8,
                                      dtype=torch.float32, seed=1)  # fmt: skip
    meta.fresh_seqs = ((0, 0, 24),)
    check_attention(q, k, v, cache, meta, 32**-0.5)
    assert kernel_seqs[-1] == ((0, 24),)
    # a head size the kernel does not take (not a power of two): the paged kernel, same rows
    assert not paged_attention.fresh_kernel_takes(*(torch.empty(4, 2, 24),) * 3)
    assert fresh_prefill._seqs_on_device.cache_info().currsize >= 1


def test_long_chunks_after_a_cached_prefix_take_sdpa_over_their_whole_sequence(monkeypatch):
    """A later chunk of a prompt (AttentionMetadata.chunk_seqs) where the front padding pays
    (`pad_front_pays`: few cached tokens for its length) is attended by one causal SDPA call over
    its whole sequence, gathered from the cache (an FP8 cache's times its scales); one with many
    cached tokens keeps the kernel. Every row as the reference, beside decodes and a fresh prompt."""
    monkeypatch.setattr(paged_attention, "SDPA_PREFILL_TOKENS", 16)
    monkeypatch.setattr(paged_attention, "SDPA_CHUNK_MIN_TOKENS", 40)
    assert paged_attention.pad_front_pays(10, 40) and paged_attention.pad_front_pays(0, 40)
    assert not paged_attention.pad_front_pays(60, 20) and not paged_attention.pad_front_pays(30, 15)
    assert not paged_attention.pad_front_pays(5, 30)  # the ratio would pay, but too short in all
    # decodes, a chunk after 10 cached (SDPA), a fresh prompt (SDPA), a chunk after 60 (kernel),
    # a chunk after 13 whose page is shared with the cached tokens (SDPA)
    qlens, slens = [1, 1, 40, 24, 20, 30], [9, 30, 50, 24, 80, 43]
    fresh, chunks = ((3, 42, 24),), ((2, 2, 40, 10), (4, 66, 20, 60), (5, 86, 30, 13))
    calls, launches = [], []
    original_after, original_launch = paged_attention.sdpa_after_prefix, paged_attention._launch
    monkeypatch.setattr(paged_attention, "sdpa_after_prefix",
                        lambda q, *a, **kw: calls.append(q.shape[0]) or original_after(q, *a, **kw))  # fmt: skip
    monkeypatch.setattr(
        paged_attention, "_launch", lambda *a, **kw: launches.append(a[6:9]) or original_launch(*a, **kw)
    )
    for dtype in (torch.float32, torch.float16):
        q, k, v, cache, meta = make_batch(qlens, slens, num_heads=8, num_kv_heads=2, head_dim=32, block_size=8,
                                          dtype=dtype, seed=5)  # fmt: skip
        meta.num_decode_seqs, meta.fresh_seqs, meta.chunk_seqs = 2, fresh, chunks
        check_attention(q, k, v, cache, meta, 32**-0.5)
    assert calls == [40, 30] * 2 and launches == [(0, 2, 2), (4, 1, 20)] * 2
    # an FP8 cache with per-layer scales: the gathered keys and values are scaled back (the fresh
    # prompt not listed: by SDPA it would attend over its unquantized new K/V, not the cache's)
    from llmserve.attention_metadata import to_cache_dtype

    q, k, v, cache, meta = make_batch(qlens, slens, num_heads=8, num_kv_heads=2, head_dim=32, block_size=8,
                                      dtype=torch.float32, seed=6)  # fmt: skip
    meta.num_decode_seqs, meta.chunk_seqs = 2, chunks
    scales = (0.02, 0.01)
    fp8 = torch.stack([to_cache_dtype(cache[i], torch.float8_e4m3fn, scales[i]) for i in (0, 1)])
    check_attention(q, k, v, fp8, meta, 32**-0.5, kv_scales=scales)
    # padded to a longer shared length (as on a GPU): still exact
    q, k, v, cache, meta = make_batch([40], [50], num_heads=8, num_kv_heads=2, head_dim=32, block_size=8,
                                      dtype=torch.float32, seed=7)  # fmt: skip
    ref = reference_paged_attention(q, k, v, cache.clone(), meta, 32**-0.5)
    paged_attention.write_kv(k, v, cache, meta.slot_mapping)
    got = original_after(q, cache, meta.block_tables[0], 10, 32**-0.5, pad_to=67)
    torch.testing.assert_close(got, ref, **TOL[torch.float32])


def test_the_input_builder_lists_fresh_sequences():
    """Sequences of several new tokens from position 0 are listed with their first row; decodes
    and chunks after cached tokens are not, but the latter go to `chunk_seqs` (with their cached
    tokens) when their whole sequence fits the builder's limit."""
    from llmserve.engine.input_builder import InputBuilder, RowInput

    builder = InputBuilder(block_size=4, max_num_seqs=8, max_blocks=8)
    rows = [
        RowInput("d", [1, 2], 5, 1, list(range(6)), True),
        RowInput("p", [3, 4], 0, 7, list(range(7)), True),
        RowInput("c", [5, 6, 7], 4, 6, list(range(10)), True),
        RowInput("q", [0], 0, 3, [1, 2, 3], False),
    ]
    batch = builder.build(rows)
    assert (
        batch.fresh_seqs == ((1, 1, 7), (3, 14, 3))
        and batch.metadata(torch.device("cpu")).fresh_seqs == batch.fresh_seqs
    )
    assert batch.chunk_seqs == ()  # no limit given: later chunks are not listed
    listed = InputBuilder(block_size=4, max_num_seqs=8, max_blocks=8, chunk_total_limit=10).build(rows)
    assert listed.chunk_seqs == ((2, 8, 6, 4),) and listed.metadata(torch.device("cpu")).chunk_seqs == listed.chunk_seqs
    assert InputBuilder(block_size=4, max_num_seqs=8, max_blocks=8, chunk_total_limit=9).build(rows).chunk_seqs == ()


def test_sdpa_buckets_share_plans_with_little_padding():
    assert [paged_attention.sdpa_bucket(n) for n in (2048, 2049, 4001, 7680, 7681, 16384, 30000)] == [
        2048,
        2176,
        4096,
        7680,
        7936,
        16384,
        30720,
    ]
    for n in range(2048, 40000, 37):
        assert n <= paged_attention.sdpa_bucket(n) <= n * 17 / 16
    # the warm-up builds each padded length once (here on the CPU, where SDPA never pads)
    assert paged_attention.warmup_sdpa_prefill(4, 2, 16, torch.float32, torch.device("cpu"), 2600) == len(
        {paged_attention.sdpa_bucket(n) for n in range(2048, 2601)}
    )


@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_attention_reads_and_writes_an_fp8_cache(num_splits):
    """An FP8 (E4M3) KV cache: the kernel writes the same bytes as the reference (saturating
    at +-448) and attends over them as the reference does, split-KV included."""
    q, k, v, cache, meta = make_batch(MIXED_QLENS, MIXED_SEQLENS, num_heads=8, num_kv_heads=2, head_dim=32,
                                      block_size=8, dtype=torch.float32, skip_tokens=MIXED_SKIP)  # fmt: skip
    k[0, 0, :4] = torch.tensor([1000.0, -1000.0, 447.0, 0.001])  # out of range, and tiny
    cache = cache.clamp(-448, 448).to(torch.float8_e4m3fn)
    check_attention(q, k, v, cache, meta, 32**-0.5, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_an_fp8_cache_with_per_layer_scales(num_splits):
    """Keys and values stored divided by the layer's scales (--kv-cache-dtype fp8 with
    calibrated or checkpoint scales): the kernel writes the reference's bytes and attends as
    it does; small values keep more bits than with scale 1, and a bfloat16 cache ignores them."""
    q, k, v, cache, meta = make_batch(MIXED_QLENS, MIXED_SEQLENS, num_heads=8, num_kv_heads=2, head_dim=32,
                                      block_size=8, dtype=torch.float32, skip_tokens=MIXED_SKIP)  # fmt: skip
    from llmserve.attention_metadata import to_cache_dtype

    k, v = k * 0.02, v * 0.005  # values around 2^-6, where E4M3 has only subnormals
    cache = torch.stack([cache[0] * 0.02, cache[1] * 0.005])  # the cached context too
    scales = (float(cache[0].abs().amax()) * 2 / 448, float(cache[1].abs().amax()) * 2 / 448)

    def fp8(pair):
        return torch.stack([to_cache_dtype(cache[i], torch.float8_e4m3fn, pair[i]) for i in (0, 1)])

    scaled = check_attention(q, k, v, fp8(scales), meta, 32**-0.5, num_splits=num_splits, kv_scales=scales)
    one = check_attention(q, k, v, fp8((1.0, 1.0)), meta, 32**-0.5, num_splits=num_splits)
    exact = reference_paged_attention(q, k, v, cache.clone(), meta, 32**-0.5)
    err = [float((o - exact).abs().max()) for o in (scaled, one)]
    assert err[0] < err[1] / 3, err  # about 4x smaller here
    # an unquantized cache ignores the scales
    plain = K.triton_paged_attention(q, k, v, cache.clone(), meta, 32**-0.5, kv_scales=(3.0, 5.0))
    torch.testing.assert_close(plain, exact, **TOL[torch.float32])


def test_long_prefill_tiles_only_for_16_bit_queries():
    # float32's 256 x 64 tiles at head dim 128 need more shared memory than an H100 has (263,680 of 232,448 bytes)
    fit = paged_attention.long_tiles_fit
    assert fit(torch.bfloat16, 128) and fit(torch.float16, 128) and fit(torch.bfloat16, 64)
    assert not fit(torch.float32, 128) and not fit(torch.bfloat16, 256)  # as much shared memory as float32 at 128


def test_choose_num_splits_policy():
    sms = 132
    # enough programs already: no split
    assert K.choose_num_splits(32, 8, 8192, sms) == 1
    assert K.choose_num_splits(256, 8, 512, sms) == 1
    # batch 1, long context: many splits, capped
    s = K.choose_num_splits(1, 8, 8192, sms)
    assert 8 <= s <= paged_attention.MAX_SPLITS
    # short context: shares never shorter than MIN_TOKENS_PER_SPLIT
    assert K.choose_num_splits(1, 8, 300, sms) == 300 // paged_attention.MIN_TOKENS_PER_SPLIT
    assert K.choose_num_splits(1, 8, 100, sms) == 1
    # more parallelism -> fewer splits
    assert K.choose_num_splits(4, 8, 8192, sms) < K.choose_num_splits(1, 8, 8192, sms)
    # the values an H200 sweep found best (bf16, 8 KV heads, block 16)
    assert K.choose_num_splits(1, 8, 8192, sms) == 32
    assert K.choose_num_splits(2, 8, 8192, sms) == 16
    assert K.choose_num_splits(8, 8, 2048, sms) == 4
    assert K.choose_num_splits(16, 8, 4096, sms) == 2
    assert K.choose_num_splits(128, 8, 1024, sms) == 1


# -- sliding window (Gemma 3's local layers, Mistral): the query at p sees keys in (p - W, p] ---------------


def dense_window_attention(q, kv_cache, meta, scale, window):
    """Each query against every key of its sequence by plain float64 products and a masked softmax, the
    keys read slot by slot through the block table (the K/V already written)."""
    bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
    group = q.shape[1] // hkv
    flat = kv_cache.double().flatten(1, 2)  # [2, slots, Hkv, D]
    out = torch.zeros(q.shape, dtype=torch.float64)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        first, end = starts[i], starts[i + 1]
        pos = torch.arange(seq_len)
        slots = meta.block_tables[i, pos // bs].long() * bs + pos % bs
        keys, values = flat[0, slots].repeat_interleave(group, 1), flat[1, slots].repeat_interleave(group, 1)
        q_pos = torch.arange(seq_len - (end - first), seq_len)
        scores = torch.einsum("thd,khd->htk", q[first:end].double(), keys) * scale
        visible = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[first:end] = torch.einsum("htk,khd->thd", probs, values)
    return out


def test_the_reference_window_is_a_dense_masked_softmax():
    """`reference_paged_attention(window=)` against a plain masked softmax: windows of one key,
    smaller than a block, not a multiple of the block size, equal to a sequence's length (22) and
    to the longest (41), longer than all; GQA of 2; the mixed batch (decodes, a fresh prompt, chunks
    after cached tokens, an empty sequence, a padding token). A window over the whole context is the
    full attention, bit for bit."""
    q, k, v, cache, meta = make_batch(MIXED_QLENS, MIXED_SEQLENS, num_heads=4, num_kv_heads=2, head_dim=16,
                                      block_size=8, dtype=torch.float32, skip_tokens=MIXED_SKIP, seed=12)  # fmt: skip
    full = reference_paged_attention(q, k, v, cache.clone(), meta, 0.3)
    for window in (1, 3, 5, 13, 22, 41, 100):
        written = cache.clone()
        got = reference_paged_attention(q, k, v, written, meta, 0.3, window=window)
        torch.testing.assert_close(got.double(), dense_window_attention(q, written, meta, 0.3, window),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip
        if window >= max(MIXED_SEQLENS):
            assert torch.equal(got, full)
        else:
            assert not torch.equal(got, full)
    one = reference_paged_attention(q, k, v, cache.clone(), meta, 0.3, window=1)  # each query sees its own key only
    last = meta.query_start_loc[1:2] - 1  # the decode of sequence 0 (written, not skipped)
    torch.testing.assert_close(one[last], v[last].repeat_interleave(2, 1), atol=1e-6, rtol=1e-6)


# (num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits, window): windows of one key, below a
# block, not multiples of the block size, equal to sequences' lengths (22, 41), longer than all
WINDOW_CASES = [
    pytest.param(4, 4, 32, 16, torch.float32, 1, 5, id="gqa1-bs16-fp32-w5"),
    pytest.param(4, 2, 16, 8, torch.float32, 3, 13, id="gqa2-bs8-fp32-split3-w13"),
    pytest.param(4, 1, 16, 4, torch.float32, 1, 1, id="gqa4-bs4-fp32-w1"),
    pytest.param(4, 1, 24, 8, torch.float32, 4, 22, id="gqa4-bs8-d24-fp32-split4-w22"),
    pytest.param(4, 2, 16, 4, torch.float32, 2, 41, id="gqa2-bs4-fp32-split2-w41"),
    pytest.param(4, 2, 16, 8, torch.float32, 1, 100, id="gqa2-bs8-fp32-w100"),
    pytest.param(4, 1, 32, 16, torch.float16, 2, 7, id="gqa4-bs16-fp16-split2-w7"),
    pytest.param(4, 2, 16, 4, torch.float16, 1, 17, id="gqa2-bs4-fp16-w17"),
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype,num_splits,window", WINDOW_CASES)
def test_paged_attention_in_a_sliding_window(num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits,
                                             window):  # fmt: skip
    """The kernel with a window against the reference with it, over the mixed batch (decodes, a fresh
    prompt, chunks after cached tokens, an empty sequence, a padding token), split-KV forced on or off;
    and multi-tile prefill chunks (the binary search over tiles) in the same window."""
    batch = make_batch(MIXED_QLENS, MIXED_SEQLENS, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       block_size=block_size, dtype=dtype, skip_tokens=MIXED_SKIP, seed=window)  # fmt: skip
    check_attention(*batch, head_dim**-0.5, num_splits=num_splits, window=window)
    cfg = K.AttnLaunchConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)  # tiles of 16 // group tokens
    batch = make_batch([1, 10, 7], [9, 10, 25], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       block_size=block_size, dtype=dtype, strided_qkv=True, seed=window + 1)  # fmt: skip
    check_attention(*batch, head_dim**-0.5, config=cfg, num_splits=num_splits, window=window)


def test_a_window_over_the_whole_context_gives_the_full_attentions_bits():
    """The SLIDING variants with a window no query reaches past: the same bits as full attention
    (the same blocks, sums and order), in the paged kernel (split or not) and the fresh kernel."""
    from llmserve.kernels.fresh_prefill import fresh_prefill_attention

    q, k, v, cache, meta = make_batch(MIXED_QLENS, MIXED_SEQLENS, num_heads=4, num_kv_heads=2, head_dim=16,
                                      block_size=8, dtype=torch.float32, skip_tokens=MIXED_SKIP, seed=2)  # fmt: skip
    K.write_kv(k, v, cache, meta.slot_mapping)
    for splits in (1, 3):
        full = K.paged_attention_forward(q, cache, meta, 0.3, num_splits=splits)
        assert torch.equal(K.paged_attention_forward(q, cache, meta, 0.3, num_splits=splits, window=41), full)
    assert not torch.equal(K.paged_attention_forward(q, cache, meta, 0.3, num_splits=3, window=40), full)
    torch.manual_seed(2)
    q, k, v = torch.randn(40, 2, 16), torch.randn(40, 1, 16), torch.randn(40, 1, 16)
    seqs, cfg = ((0, 24), (24, 16)), (16, 16, 1, 1)
    full = fresh_prefill_attention(q, k, v, seqs, 0.3, torch.zeros_like(q), cfg)
    assert torch.equal(fresh_prefill_attention(q, k, v, seqs, 0.3, torch.zeros_like(q), cfg, window=24), full)
    assert not torch.equal(fresh_prefill_attention(q, k, v, seqs, 0.3, torch.zeros_like(q), cfg, window=23), full)


def poison_before_window(cache, meta, window, block_n):
    """NaN in every cached key and value of the blocks of `block_n` keys that lie wholly before the
    window of each sequence's first new query: a kernel that reads one of them returns NaN."""
    bs = cache.shape[2]
    flat = cache.view(2, -1, *cache.shape[3:])
    qlens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist()
    for i, (seq_len, q_len) in enumerate(zip(meta.seq_lens.tolist(), qlens)):
        first = seq_len - q_len
        below = max(first - window + 1, 0) // block_n * block_n
        pos = torch.arange(below)
        flat[:, meta.block_tables[i, pos // bs].long() * bs + pos % bs] = float("nan")


@pytest.mark.filterwarnings("ignore:All-NaN slice", "ignore:invalid value encountered")  # (the NaN cache, last)
@pytest.mark.parametrize("num_splits", [1, 4, None])
def test_the_window_bounds_the_blocks_a_query_reads(num_splits, monkeypatch):
    """Long contexts in a window of 20: every key block wholly before the window of a sequence's first
    query is NaN in the cache, and the output is still finite and the reference's (on the clean
    cache); decodes (split into two launches too) and a chunk after cached tokens. Without the window
    the same cache gives NaN. The split count is chosen by the keys a tile reads (window + query), not
    the context's length."""
    cfg = K.AttnLaunchConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)
    qlens, slens = [1, 1, 5], [300, 77, 150]
    q, k, v, cache, meta = make_batch(qlens, slens, num_heads=4, num_kv_heads=2, head_dim=16, block_size=8,
                                      dtype=torch.float32, seed=9)  # fmt: skip
    meta.num_decode_seqs = 2
    ref = reference_paged_attention(q, k, v, cache.clone(), meta, 0.3, window=20)
    poison_before_window(cache, meta, 20, cfg.block_n)
    K.write_kv(k, v, cache, meta.slot_mapping)
    assert cache.isnan().any()
    lengths = []
    original = paged_attention.choose_num_splits
    monkeypatch.setattr(paged_attention, "choose_num_splits",
                        lambda *a, **kw: lengths.append(a[2]) or original(*a, **kw))  # fmt: skip
    for split_decodes in (False, True):
        got = K.paged_attention_forward(q, cache, meta, 0.3, config=cfg, num_splits=num_splits, window=20,
                                        split_decodes=split_decodes)  # fmt: skip
        torch.testing.assert_close(got, ref, **TOL[torch.float32])
    if num_splits is None:  # one launch: up to 20 + 5 keys; the decodes' own: 20 + 1; the chunk's: 20 + 5
        assert lengths == [25, 21, 25]
    assert K.paged_attention_forward(q, cache, meta, 0.3, config=cfg, num_splits=num_splits).isnan().any()


def test_the_fresh_prefill_kernel_in_a_sliding_window(monkeypatch):
    """`fresh_prefill_attention(window=)` against each prompt's masked SDPA (keys in (p - W, p]):
    windows of one key, not multiples of the tiles, longer than the prompts; GQA of 4, float32 and
    float16, prompts on and off the tiles, the rows of an unlisted sequence untouched. Each program
    reads its window's keys and its own: at most W + BLOCK_M + BLOCK_N - 2 of a 200-token prompt."""
    from llmserve.kernels import fresh_prefill

    hq, hkv, d = 4, 1, 32
    lens = [70, 5, 64, 129]  # the third not listed
    rows = sum(lens)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    seqs = tuple((starts[i], lens[i]) for i in (0, 1, 3))
    for dtype, windows in ((torch.float32, (1, 7, 45, 200)), (torch.float16, (7, 45))):
        torch.manual_seed(6)
        qkv = torch.randn(rows, (hq + 2 * hkv) * d, dtype=dtype)
        q, k, v = (t.view(rows, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], -1))
        for window in windows:
            out = torch.full_like(q, 7.0)
            fresh_prefill.fresh_prefill_attention(q, k, v, seqs, d**-0.5, out, window=window)
            for first, n in seqs:
                qs, ks, vs = (t[first : first + n].transpose(0, 1)[None].float() for t in (q, k, v))
                pos = torch.arange(n)
                mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
                ref = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=d**-0.5, enable_gqa=True)
                torch.testing.assert_close(out[first : first + n].float(), ref[0].transpose(0, 1), **TOL[dtype])
            assert (out[starts[2] : starts[2] + 64] == 7.0).all()
    read = []  # the keys of each key-range call, in the order the programs run them
    original = fresh_prefill._attend_keys

    def value(x):  # an interpreter tensor's value, or a plain int
        return int(x.handle.data.item()) if hasattr(x, "handle") else int(x)

    def spy(acc, l_i, m_i, q, k_base, v_base, lo, hi, *rest):
        read.append(max(0, value(hi) - value(lo)))
        return original(acc, l_i, m_i, q, k_base, v_base, lo, hi, *rest)

    monkeypatch.setattr(fresh_prefill, "_attend_keys", spy)
    torch.manual_seed(7)
    q, k, v = torch.randn(200, 1, 16), torch.randn(200, 1, 16), torch.randn(200, 1, 16)
    out = torch.empty_like(q)
    fresh_prefill.fresh_prefill_attention(q, k, v, ((0, 200),), 0.25, out, (16, 16, 1, 1), window=20)
    per_program = [sum(read[i : i + 3]) for i in range(0, len(read), 3)]  # three ranges a program in a window
    assert len(per_program) == 13 and max(per_program) <= 20 + 16 + 16 - 2
    read.clear()
    fresh_prefill.fresh_prefill_attention(q, k, v, ((0, 200),), 0.25, out, (16, 16, 1, 1))
    assert max(sum(read[i : i + 2]) for i in range(0, len(read), 2)) == 200  # full attention: the last tile reads all


def test_a_windowed_layer_takes_no_sdpa(monkeypatch):
    """SDPA's causal mask has no window: with one, the fresh prompts long enough for SDPA go to the
    fresh kernel (which takes a window), the later chunks SDPA would take to the paged kernel, and
    every row is the windowed reference's; the same batch without a window takes SDPA as before."""
    from llmserve.kernels import fresh_prefill

    monkeypatch.setattr(paged_attention, "SDPA_PREFILL_TOKENS", 16)
    monkeypatch.setattr(paged_attention, "FRESH_KERNEL_TOKENS", 8)
    monkeypatch.setattr(paged_attention, "SDPA_CHUNK_MIN_TOKENS", 40)
    qlens, slens = [1, 1, 40, 24, 20, 6], [9, 30, 50, 24, 80, 6]
    fresh, chunks = ((3, 42, 24), (5, 86, 6)), ((2, 2, 40, 10), (4, 66, 20, 60))
    calls, kernel_seqs = [], []
    original_fresh = fresh_prefill.fresh_prefill_attention
    for name in ("sdpa_prefill", "sdpa_after_prefix"):
        original = getattr(paged_attention, name)
        monkeypatch.setattr(paged_attention, name,
                            lambda *a, _n=name, _f=original, **kw: calls.append(_n) or _f(*a, **kw))  # fmt: skip
    monkeypatch.setattr(paged_attention, "fresh_prefill_attention", lambda q, k, v, seqs, *a, **kw:
                        kernel_seqs.append(seqs) or original_fresh(q, k, v, seqs, *a, **kw))  # fmt: skip
    for window in (None, 12):
        q, k, v, cache, meta = make_batch(qlens, slens, num_heads=8, num_kv_heads=2, head_dim=32, block_size=8,
                                          dtype=torch.float32, seed=4)  # fmt: skip
        meta.num_decode_seqs, meta.fresh_seqs, meta.chunk_seqs = 2, fresh, chunks
        check_attention(q, k, v, cache, meta, 32**-0.5, window=window)
    assert calls == ["sdpa_after_prefix", "sdpa_prefill"]  # without the window only
    assert kernel_seqs == [(), ((42, 24),)]
    calls.clear()
    q, k, v, cache, meta = make_batch([40], [40], num_heads=8, num_kv_heads=2, head_dim=32, block_size=8,
                                      dtype=torch.float32, seed=5)  # fmt: skip
    assert paged_attention.fresh_single_prefill(meta)  # alone in its step: the fresh kernel too
    check_attention(q, k, v, cache, meta, 32**-0.5, window=12)
    assert calls == [] and kernel_seqs[-1] == ((0, 40),)


def test_the_warmups_compile_the_sliding_variants(monkeypatch):
    """`window=` on the warm-ups (the runner's, for a model with sliding layers): the same launches as
    the full variants', each with the window (its SLIDING variant), reading the cache and writing nothing."""
    from llmserve.kernels import fresh_prefill

    kv_cache = torch.randn(2, 4, 4, 1, 16)  # one KV head, one query head: fewer interpreted programs
    before = kv_cache.clone()
    units, windows = [], []
    launch = paged_attention._launch
    monkeypatch.setattr(paged_attention, "_launch",
                        lambda *a, **kw: windows.append(kw.get("window")) or launch(*a, **kw))  # fmt: skip
    n = paged_attention.warmup_paged_attention(1, kv_cache, 0.25, max_batch=2, dtype=torch.float32,
                                               submit=units.append, window=5)  # fmt: skip
    assert n == len(units) == 3 * len(paged_attention.split_counts())
    outs = [units[i]() for i in (0, -1)]  # a decode, split once; the 128-token prefill, split the most
    assert windows == [5, 5] and all(torch.isfinite(o).all() for o in outs) and torch.equal(kv_cache, before)
    fresh_units, fresh_windows = [], []
    original = fresh_prefill.fresh_prefill_attention
    monkeypatch.setattr(fresh_prefill, "fresh_prefill_attention",
                        lambda *a, **kw: fresh_windows.append(kw.get("window")) or original(*a, **kw))  # fmt: skip
    assert fresh_prefill.warmup_fresh_prefill(1, 1, 16, torch.float32, torch.device("cpu"), fresh_units.append,
                                              window=5) == len(fresh_units) == 3  # fmt: skip
    fresh_units[0]()
    assert fresh_windows == [5]


def test_write_kv_matches_reference_and_skips_negative_slots():
    g = torch.Generator().manual_seed(5)
    k = torch.randn(6, 2, 16, generator=g)
    v = torch.randn(6, 2, 16, generator=g)
    cache = torch.randn(2, 5, 4, 2, 16, generator=g)
    slots = torch.tensor([3, -1, 17, 0, -1, 19], dtype=torch.int64)
    ref = cache.clone()
    write_kv_cache(k, v, ref, slots)
    out = cache.clone()
    cache_write.write_kv(k, v, out, slots)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    assert not torch.equal(out, cache)  # something was written
    flat = out.view(2, -1, 2, 16)
    torch.testing.assert_close(flat[0, 17], k[2], atol=0, rtol=0)


# -- norm / rotary / activation -------------------------------------------------------------

SMALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", SMALL_DTYPES)
def test_rms_norm(dtype):
    g = torch.Generator().manual_seed(1)
    ref = RMSNorm(48, 1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(48, generator=g))
    x = (torch.randn(5, 48, generator=g) * 3).to(dtype)
    out = norm.rms_norm(x, ref.weight.detach(), 1e-5)
    expect = ref(x)
    assert out.dtype == expect.dtype
    torch.testing.assert_close(out, expect.detach(), **TOL[dtype])


@pytest.mark.parametrize("dtype", SMALL_DTYPES)
@pytest.mark.parametrize("tokens", [1, 3])
def test_qk_rms_norm_in_one_launch_equals_two_norms(dtype, tokens):
    """Qwen3's q and k head norms in one launch, read through the fused QKV output's strides (q and
    k are views of it, as Attention.project makes them), equal to the reference's two norms."""
    from llmserve.model.layers import qk_rms_norm as ref_qk_rms_norm

    g = torch.Generator().manual_seed(3 + tokens)
    n_q, n_k, d = 4, 2, 32
    qkv = (torch.randn(tokens, (n_q + 2 * n_k) * d, generator=g) * 3).to(dtype)
    q, k, _ = qkv.split([n_q * d, n_k * d, n_k * d], dim=-1)
    q, k = q.view(-1, n_q, d), k.view(-1, n_k, d)
    qw, kw = (torch.randn(d, generator=g).to(dtype) for _ in range(2))
    got_q, got_k = norm.qk_rms_norm(q, k, qw, kw, 1e-6)
    want_q, want_k = ref_qk_rms_norm(q, k, qw, kw, 1e-6)
    assert got_q.shape == want_q.shape and got_k.shape == want_k.shape and got_q.dtype == want_q.dtype
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    assert not torch.equal(got_q, q)  # (normalised: a copy of the input would fail the closeness above)


@pytest.mark.parametrize("dtype", SMALL_DTYPES)
def test_fused_add_rms_norm(dtype):
    g = torch.Generator().manual_seed(2)
    ref = RMSNorm(40, 1e-6).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(40, generator=g))
    x = torch.randn(2, 3, 40, generator=g).to(dtype)
    residual = torch.randn(2, 3, 40, generator=g).to(dtype)
    x_before, r_before = x.clone(), residual.clone()
    out, new_res = norm.fused_add_rms_norm(x, residual, ref.weight.detach(), 1e-6)
    expect, expect_res = ref(x, residual)
    if dtype == torch.bfloat16:  # the interpreter's fp32->bf16 cast truncates (1 ulp off)
        torch.testing.assert_close(new_res, expect_res, **TOL[dtype])
    else:  # the add is rounded once, as in the reference: exact
        torch.testing.assert_close(new_res, expect_res, atol=0, rtol=0)
    torch.testing.assert_close(out, expect.detach(), **TOL[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, r_before)


@pytest.mark.parametrize("dtype", SMALL_DTYPES)
def test_norm_and_activation_add_a_float32_delta_first(dtype):
    """The `delta=` of the fused add-norm and of silu_and_mul (a LoRA layer's deferred delta,
    llmserve/lora/deferred.py): the same as `x.add_(delta)` before the op, kernel and reference,
    and the inputs untouched."""
    from llmserve.model.layers import fused_add_rms_norm as ref_fused_add_rms_norm

    g = torch.Generator().manual_seed(9)
    w = torch.randn(40, generator=g).to(dtype)
    x = (torch.randn(3, 40, generator=g) * 2).to(dtype)
    residual = torch.randn(3, 40, generator=g).to(dtype)
    delta = torch.randn(3, 40, generator=g)  # float32
    x_before = x.clone()
    added = x.clone().add_(delta)
    tol = dict(atol=0, rtol=0) if dtype != torch.bfloat16 else TOL[dtype]  # (the interpreter's bf16 cast truncates)
    want_out, want_res = ref_fused_add_rms_norm(added, residual, w, 1e-6)
    ref_out, ref_res = ref_fused_add_rms_norm(x, residual, w, 1e-6, delta=delta)
    assert torch.equal(ref_out, want_out) and torch.equal(ref_res, want_res)  # the reference: exactly the add first
    out, new_res = norm.fused_add_rms_norm(x, residual, w, 1e-6, delta=delta)
    torch.testing.assert_close(new_res, want_res, **tol)
    torch.testing.assert_close(out, want_out, **TOL[dtype])
    plain_out, _ = norm.fused_add_rms_norm(x, residual, w, 1e-6)
    assert not torch.equal(out, plain_out)  # the delta was added
    if dtype != torch.bfloat16:  # the kernel itself after torch's add: the same bits (its rounding is the add's)
        first_out, first_res = norm.fused_add_rms_norm(added, residual, w, 1e-6)
        assert torch.equal(out, first_out) and torch.equal(new_res, first_res)
    h = (torch.randn(3, 2 * 40, generator=g) * 3).to(dtype)
    h_delta = torch.randn(3, 2 * 40, generator=g)
    want = ref_silu_and_mul(h.clone().add_(h_delta))
    assert torch.equal(ref_silu_and_mul(h, delta=h_delta), want)
    act_tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else TOL[dtype]
    h_before, residual_before = h.clone(), residual.clone()
    got = activation.silu_and_mul(h, delta=h_delta)
    torch.testing.assert_close(got, want, **act_tol)
    assert not torch.equal(got, activation.silu_and_mul(h))
    if dtype != torch.bfloat16:
        assert torch.equal(got, activation.silu_and_mul(h.clone().add_(h_delta)))
    assert torch.equal(x, x_before) and torch.equal(h, h_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", SMALL_DTYPES)
def test_rotary(dtype):
    head_dim, n_q, n_k, tokens = 32, 4, 2, 7
    rope = RotaryEmbedding(
        head_dim, 64,
        RopeConfig(theta=10000.0, rope_type="llama3", factor=8.0,
                   original_max_position_embeddings=16),
    )  # fmt: skip
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, (n_q + 2 * n_k) * head_dim, generator=g).to(dtype)
    q, k, _ = qkv.split([n_q * head_dim, n_k * head_dim, n_k * head_dim], dim=-1)
    q = q.view(tokens, n_q, head_dim)  # strided views, as the model produces them
    k = k.view(tokens, n_k, head_dim)
    positions = torch.tensor([0, 5, 63, 2, 2, 17, 40])
    eq, ek = rope(positions, q, k)
    oq, ok = rotary.apply_rotary(q, k, positions, rope.cos_sin)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(oq, eq, **tol)
    torch.testing.assert_close(ok, ek, **tol)
    assert not torch.equal(oq, q)  # it did rotate
    q2, k2 = q.clone(), k.clone()
    iq, ik = rotary.apply_rotary(q2, k2, positions, rope.cos_sin, inplace=True)
    assert iq.data_ptr() == q2.data_ptr()
    torch.testing.assert_close(q2, eq, **tol)
    torch.testing.assert_close(k2, ek, **tol)


@pytest.mark.parametrize("dtype", SMALL_DTYPES)
def test_silu_and_mul(dtype):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(2, 3, 2 * 40, generator=g) * 3).to(dtype)
    out = activation.silu_and_mul(x)
    expect = ref_silu_and_mul(x)
    assert out.shape == (2, 3, 40)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(out, expect, **tol)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # (numpy's exp, under the interpreter)
@pytest.mark.parametrize("dtype", SMALL_DTYPES)
def test_gelu_tanh_and_mul(dtype):
    """GeGLU's activation (Gemma's MLP): the kernel against the reference, which is torch's tanh GELU
    of the gate times up; the tails (+-30: gelu 0 or the gate itself, 1e4 and -1e4 whose tanh term
    overflows), zeros and tiny gates, an odd width over two column blocks, a strided row; the
    `delta` added first as silu_and_mul's; no rows."""
    from llmserve.model.layers import gelu_tanh_and_mul as ref_gelu_tanh_and_mul

    g = torch.Generator().manual_seed(8)
    inter = 1030  # two column blocks of 1024, the second almost empty
    x = (torch.randn(4, 2 * inter + 5, generator=g) * 3).to(dtype)
    x[0, :8] = torch.tensor([0.0, -0.0, 1e-7, -1e-7, 30.0, -30.0, 1e4, -1e4]).to(dtype)
    x = x[:, : 2 * inter]  # rows with a stride
    gate, up = x.chunk(2, dim=-1)
    expect = ref_gelu_tanh_and_mul(x)
    assert torch.equal(expect, F.gelu(gate, approximate="tanh") * up)
    out = activation.gelu_tanh_and_mul(x)
    assert out.shape == (4, inter) and out.dtype == dtype
    # float32: torch's `1 + tanh(u)` is rounded next to 1, so in the negative tail its result is off by up
    # to |gate * up| * 2^-24 (0 where the kernel's `g * sigmoid(2u)` keeps a value of 1e-6 here)
    tol = dict(atol=1e-5, rtol=1e-6) if dtype == torch.float32 else TOL[dtype]
    torch.testing.assert_close(out, expect, **tol)
    assert torch.isfinite(out.float()).all()
    assert not torch.equal(out, activation.silu_and_mul(x))  # the activation is the one asked for
    delta = torch.randn(4, 2 * inter, generator=g)
    want = ref_gelu_tanh_and_mul(x.clone().add_(delta))
    assert torch.equal(ref_gelu_tanh_and_mul(x, delta=delta), want)
    torch.testing.assert_close(activation.gelu_tanh_and_mul(x, delta=delta), want, **tol)
    assert activation.gelu_tanh_and_mul(x[:0]).shape == (0, inter)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize(("dtype", "one_pass_cols"), [(torch.float32, 16384), (torch.float16, 16384),
                                                     (torch.bfloat16, 16384), (torch.bfloat16, 32)])  # fmt: skip
def test_gelu_tanh_and_mul_quantized_in_its_pass_equals_the_reference(dtype, one_pass_cols, monkeypatch):
    """GeGLU's activation writing FP8 rows and scales: the unquantized kernel's output then the
    per-token quantization, bit for bit, rows held whole or looped over (a small limit forces three
    steps); the reference's FP8 values up to one FP8 step; an all-zero row keeps the scale floor."""
    from llmserve.model import layers
    from llmserve.model.fp8 import quantized

    monkeypatch.setattr(activation, "ONE_PASS_COLS", one_pass_cols)
    monkeypatch.setattr(activation, "LOOP_BLOCK", 32)
    g = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(7, 2 * 80, generator=g) * 4).to(dtype)
    gate_up[4] = 0
    got, want = K.gelu_tanh_and_mul_fp8(gate_up), quantized(K.gelu_tanh_and_mul(gate_up))
    assert got.q.dtype == torch.float8_e4m3fn and got.q.shape == (7, 80) and got.dtype == want.dtype == dtype
    assert torch.equal(got.q.view(torch.uint8), want.q.view(torch.uint8)) and torch.equal(got.scale, want.scale)
    ref = layers.gelu_tanh_and_mul_fp8(gate_up)
    got_v, ref_v = got.q.float() * got.scale, ref.q.float() * ref.scale
    assert ((got_v - ref_v).abs() <= 0.13 * ref_v.abs() + ref.scale).all()
    assert got.scale[4] == torch.tensor(1e-12, dtype=torch.float32)
    assert not torch.equal(got.q.view(torch.uint8), K.silu_and_mul_fp8(gate_up).q.view(torch.uint8))
    assert K.gelu_tanh_and_mul_fp8(gate_up[:0]).q.shape == (0, 80)


def test_layer_ops_pick_the_gelu_kernels_on_the_triton_path():
    from llmserve.model.layers import REFERENCE_OPS, gelu_tanh_and_mul, gelu_tanh_and_mul_fp8, triton_ops

    assert REFERENCE_OPS.gelu_tanh_and_mul is gelu_tanh_and_mul
    assert REFERENCE_OPS.gelu_tanh_and_mul_fp8 is gelu_tanh_and_mul_fp8
    ops = triton_ops()
    assert ops.gelu_tanh_and_mul is K.gelu_tanh_and_mul and ops.gelu_tanh_and_mul_fp8 is K.gelu_tanh_and_mul_fp8
    assert ops.silu_and_mul is K.silu_and_mul and ops.linear is K.dense_linear  # the positional fields as before


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cols", [1, 37, 4096, 5000])  # one element, odd, one block, two passes
def test_quantize_tokens_fp8_equals_the_reference_bit_for_bit(dtype, cols):
    """The fused per-token FP8 quantization: the same FP8 bytes and scales as the five torch
    ops it replaces, for dynamic and static scales, an all-zero token (the scale floor), values
    past the FP8 range (saturated), rows with a stride, no rows."""
    from llmserve.kernels.fp8_quant import quantize_tokens_fp8
    from llmserve.model.fp8 import quantize_tokens

    g = torch.Generator().manual_seed(cols)
    x = (torch.randn(6, cols + 3, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1e3, 1.0, 0.0])[:, None]).to(dtype)
    x[4, 0] = 1e4 if dtype != torch.float16 else 6e4  # one large outlier: the rest round small
    x = x[:, :cols]  # rows with a stride
    for static in (None, torch.tensor(0.02)):
        got_q, got_s = quantize_tokens_fp8(x, static)
        want_q, want_s = quantize_tokens(x, static)
        assert got_q.dtype == torch.float8_e4m3fn and got_q.shape == x.shape and got_s.shape == (6, 1)
        assert torch.equal(got_s, want_s)
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    empty_q, empty_s = quantize_tokens_fp8(x[:0])
    assert empty_q.shape == (0, cols) and empty_s.shape == (0, 1)


@pytest.mark.parametrize("tokens", [5, 20])
def test_fp8_matmul_with_the_fused_quantization_against_the_reference(tokens):
    """The fast FP8 product: few tokens through the split-K kernel, more through
    `_scaled_mm` (then equal to `fp8_matmul_scaled_mm`); the reference's result either way."""
    from llmserve.kernels.fp8_linear import SMALL_M_ROWS, fp8_matmul_fused_quant
    from llmserve.model.fp8 import fp8_matmul_reference, fp8_matmul_scaled_mm, quantize_rows

    g = torch.Generator().manual_seed(9)
    weight, scale = quantize_rows(torch.randn(48, 64, generator=g) * 0.05)
    x = torch.randn(tokens, 64, generator=g).to(torch.bfloat16)
    for static in (None, torch.tensor(0.01)):
        got = fp8_matmul_fused_quant(x, weight, scale, static)
        if tokens > SMALL_M_ROWS:
            assert torch.equal(got, fp8_matmul_scaled_mm(x, weight, scale, static))
        torch.testing.assert_close(got, fp8_matmul_reference(x, weight, scale, static), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("dtype", "one_pass_cols"), [(torch.float32, 16384), (torch.bfloat16, 16384),
                                                     (torch.bfloat16, 32)])  # fmt: skip
def test_norm_and_activation_quantized_in_their_pass_equal_the_reference(dtype, one_pass_cols, monkeypatch):
    """RMSNorm (with and without the residual) and SiLU-and-multiply that write FP8 rows and
    scales: the unquantized kernel's output then the per-token quantization, bit for bit (the
    norm kernel itself matches the reference up to float32 reduction order); the residual sum
    unchanged; an all-zero row keeps the scale floor; no rows. SiLU-and-multiply holds short
    rows whole and loops over long ones (forced here with a small limit: three steps)."""
    from llmserve.model import layers
    from llmserve.model.fp8 import quantized

    monkeypatch.setattr(activation, "ONE_PASS_COLS", one_pass_cols)
    monkeypatch.setattr(activation, "LOOP_BLOCK", 32)

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 96, generator=g) * 3).to(dtype)
    x[2] = 0
    res = torch.randn(7, 96, generator=g).to(dtype)
    w = (torch.rand(96, generator=g) + 0.5).to(dtype)
    got_a, got_res = K.fused_add_rms_norm_fp8(x, res, w, 1e-5)
    want_a, want_res = K.fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(got_res, want_res)
    gate_up = (torch.randn(7, 2 * 80, generator=g) * 4).to(dtype)
    gate_up[4] = 0
    pairs = [(K.rms_norm_fp8(x, w, 1e-5), quantized(K.rms_norm(x, w, 1e-5))), (got_a, quantized(want_a)),
             (K.silu_and_mul_fp8(gate_up), quantized(K.silu_and_mul(gate_up)))]  # fmt: skip
    for a, b in pairs:
        assert a.q.dtype == torch.float8_e4m3fn and a.dtype == b.dtype == dtype
        assert torch.equal(a.q.view(torch.uint8), b.q.view(torch.uint8)) and torch.equal(a.scale, b.scale)
    ref = layers.rms_norm_fp8(x, w, 1e-5)  # and the reference's FP8 values, up to one FP8 step
    got_v, ref_v = pairs[0][0].q.float() * pairs[0][0].scale, ref.q.float() * ref.scale
    assert ((got_v - ref_v).abs() <= 0.13 * ref_v.abs() + ref.scale).all()
    floor = torch.tensor(1e-12, dtype=torch.float32)
    assert pairs[0][0].scale[2] == floor and pairs[2][0].scale[4] == floor
    assert K.rms_norm_fp8(x[:0], w, 1e-5).q.shape == (0, 96) and K.silu_and_mul_fp8(gate_up[:0]).q.shape == (0, 80)


@pytest.mark.parametrize(("m", "n", "k", "split_k"), [(1, 48, 256, None), (5, 70, 300, 3), (16, 64, 128, 1),
                                                    (33, 40, 520, None), (0, 8, 128, None)])  # fmt: skip
def test_fp8_gemm_small_m_against_the_reference(m, n, k, split_k):
    """The split-K FP8 GEMM for few tokens: the reference's product (dequantize both, float32)
    up to float32 summation order, for odd sizes, several K slices, one slice, a slice ending
    mid-tile, no rows; and the same result on every run (partials added in slice order)."""
    from llmserve.kernels import split_k_gemm as fp8_gemm
    from llmserve.kernels.split_k_gemm import fp8_gemm_small_m
    from llmserve.model.fp8 import quantize_rows, quantize_tokens

    g = torch.Generator().manual_seed(m * 1000 + n)
    weight, w_scale = quantize_rows(torch.randn(n, k, generator=g) * 0.05)
    xq, sx = quantize_tokens(torch.randn(m, k, generator=g))
    want = (xq.float() * sx) @ (weight.float() * w_scale).t()
    got = fp8_gemm_small_m(xq, sx, weight, w_scale, torch.float32, split_k=split_k, block_n=32, block_k=64)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    again = fp8_gemm_small_m(xq, sx, weight, w_scale, torch.float32, split_k=split_k, block_n=32, block_k=64)
    assert torch.equal(got, again)
    assert not fp8_gemm._workspaces[got.device].any()  # the tiles' counters are zero again after each call
    if m:
        as_bf16 = fp8_gemm_small_m(xq, sx, weight, w_scale, torch.bfloat16, split_k=split_k, block_n=32, block_k=64)
        assert as_bf16.dtype == torch.bfloat16 and torch.equal(as_bf16, got.to(torch.bfloat16))


@pytest.mark.parametrize(("m", "n", "k", "split_k"), [(1, 48, 256, None), (5, 70, 300, 3), (16, 64, 128, 1),
                                                    (8, 40, 520, None), (0, 8, 128, None)])  # fmt: skip
def test_gemm_small_m_against_f_linear(m, n, k, split_k):
    """The split-K GEMM's 16-bit form: `F.linear` in float32 up to summation order, rounded once
    to bf16, for odd sizes, several K slices, one slice, a slice ending mid-tile, no rows; the
    same result on every run, and the counters zero again."""
    import torch.nn.functional as F

    from llmserve.kernels import split_k_gemm
    from llmserve.kernels.split_k_gemm import gemm_small_m

    g = torch.Generator().manual_seed(m * 1000 + n)
    weight = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    want = F.linear(x.float(), weight.float())
    got = gemm_small_m(x, weight, split_k=split_k, block_n=32, block_k=64)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
    assert torch.equal(got, gemm_small_m(x, weight, split_k=split_k, block_n=32, block_k=64))
    if m:
        assert ((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-6).all()  # one bf16 rounding, no more
        assert not split_k_gemm._workspaces[got.device].any()
    with pytest.raises(AssertionError):
        gemm_small_m(x.float(), weight)  # operands of two dtypes: F.linear's job


def test_pdl_is_off_where_it_cannot_run(monkeypatch):
    """Off a GPU (and with LLMSERVE_PDL=0's switch) the kernels launch plainly: USE_GDC False and
    no `launch_pdl`, so the interpreter never meets griddepcontrol."""
    from llmserve.kernels import pdl

    assert pdl.launch_options(torch.device("cpu")) == {"USE_GDC": False}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert not pdl.pdl_supported(torch.device("cuda", 0))
    assert pdl.launch_options(torch.device("cuda", 0)) == {"USE_GDC": False}


def test_bf16_config_takes_the_kernel_only_where_it_was_measured_faster():
    """One token only; K split for ~256 programs up to N 8,192; wide N (gate/up, LM head) in
    128-wide tiles with K whole."""
    from llmserve.kernels.split_k_gemm import bf16_config

    assert bf16_config(2, 4096, 4096) is None and bf16_config(2, 28672, 4096) is None
    assert bf16_config(1, 28672, 4096) == {
        "block_n": 128,
        "block_k": 128,
        "split_k": 1,
        "num_warps": 4,
        "num_stages": None,
    }
    assert bf16_config(1, 4096, 4096) == {"block_n": 64, "block_k": 128, "split_k": 4, "num_warps": 4, "num_stages": 4}
    assert bf16_config(1, 4096, 14336)["split_k"] == 4 and bf16_config(1, 6144, 4096)["split_k"] == 3
    head = bf16_config(1, 128256, 4096)
    assert head["block_n"] == 128 and head["split_k"] == 1 and head["num_stages"] is None
    assert bf16_config(1, 64, 32)["split_k"] == 1  # K shorter than one step: not split


def test_dense_linear_takes_f_linear_off_the_gpu_or_with_a_bias():
    """The 16-bit projections' product: on a CPU (and with a bias, or many rows) it is `F.linear`
    itself; the model's plain projections call it."""
    import torch.nn.functional as F

    from llmserve.model.fp8 import DenseLinear, make_linear

    x, w, b = torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)
    assert torch.equal(K.dense_linear(x, w), F.linear(x, w))
    assert torch.equal(K.dense_linear(x, w, b), F.linear(x, w, b))
    layer = make_linear(16, 8, False, None, None, linear=K.dense_linear)
    assert isinstance(layer, DenseLinear) and layer.linear is K.dense_linear
    assert torch.equal(layer(x), F.linear(x, layer.weight))
    from llmserve.model.tensor_parallel import SINGLE, RowParallelLinear

    row = make_linear(16, 8, False, None, None, SINGLE, linear=K.dense_linear)  # o_proj and down_proj
    assert isinstance(row, RowParallelLinear) and row.linear is K.dense_linear
    assert torch.equal(row(x), F.linear(x, row.weight))


def test_has_triton_gpu_is_false_under_the_interpreter():
    assert K.has_triton_gpu() is False


def test_engine_with_triton_kernels_matches_transformers(llama_dir):
    """The whole engine on the Triton path (attention, KV write, norm, rotary, SiLU) under
    the interpreter: greedy tokens equal transformers', with chunked prefill."""
    import random

    from conftest import hf_greedy

    from llmserve import LLM, SamplingParams

    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(20)]
    prompts = [[1] + shared + [rng.randrange(3, 500) for _ in range(n)] for n in (3, 11)]
    want = hf_greedy(llama_dir, prompts, 6)
    llm = LLM(llama_dir, attention_backend="triton", max_model_len=64, block_size=8, max_num_batched_tokens=16)
    assert llm.config.attention_backend == "triton"
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == want


def test_engine_gives_long_chunks_to_sdpa_and_keeps_the_tokens(llama_dir, monkeypatch):
    """The engine with the SDPA thresholds lowered to this model's sizes: fresh chunks and a
    prompt's later chunk (listed by the input builder within the runner's limit) go to SDPA, and
    the greedy tokens stay transformers'."""
    import random

    from conftest import hf_greedy

    from llmserve import LLM, SamplingParams

    monkeypatch.setattr(paged_attention, "SDPA_PREFILL_TOKENS", 8)
    monkeypatch.setattr(paged_attention, "SDPA_CHUNK_MIN_TOKENS", 16)
    calls = {"fresh": 0, "chunk": 0}
    fresh, after = paged_attention.sdpa_prefill, paged_attention.sdpa_after_prefix

    def count(kind, fn):
        return lambda *a, **kw: calls.__setitem__(kind, calls[kind] + 1) or fn(*a, **kw)

    monkeypatch.setattr(paged_attention, "sdpa_prefill", count("fresh", fresh))
    monkeypatch.setattr(paged_attention, "sdpa_after_prefix", count("chunk", after))
    rng = random.Random(6)
    prompts = [[1] + [rng.randrange(3, 500) for _ in range(n)] for n in (31, 13)]
    want = hf_greedy(llama_dir, prompts, 5)
    llm = LLM(llama_dir, attention_backend="triton", max_model_len=64, block_size=8, max_num_batched_tokens=16,
              enable_prefix_caching=False)  # fmt: skip
    assert llm.core.runner.sdpa_chunk_limit == 32
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == want
    layers = llm.config.model_config.arch.num_layers
    # 16 after 16 of the 32-token prompt in every layer but the last, which attends the sampling rows
    # alone (`SampledRows`); likewise each fresh chunk
    assert calls["chunk"] == layers - 1 and calls["fresh"] == 2 * (layers - 1)


def test_engine_on_a_windowed_geglu_model_matches_transformers(tmp_path, monkeypatch):
    """Gemma 3 (random weights, sliding layers with a window of 16, GeGLU: random_model.py) on the Triton path
    under the interpreter, chunked prefill crossing the window: greedy tokens equal transformers'; the
    launches carry each layer's window (None for a full layer), and the MLP runs the GeGLU kernel."""
    import random

    from conftest import FAMILY_OVERRIDES, hf_greedy

    from llmserve import LLM, SamplingParams
    from llmserve.model.random_model import make_random_model

    # two layers, a sliding one and a full one (the shared model's six: 3x the interpreted launches)
    model_dir = str(make_random_model(tmp_path / "gemma3", "gemma3", seed=4, **FAMILY_OVERRIDES["gemma3"],
                                      num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"]))  # fmt: skip
    rng = random.Random(3)
    prompts = [[1] + [rng.randrange(3, 500) for _ in range(n)] for n in (9, 37)]
    want = hf_greedy(model_dir, prompts, 6)
    windows, gelu_calls = set(), []
    launch, gelu = paged_attention._launch, K.gelu_tanh_and_mul
    monkeypatch.setattr(paged_attention, "_launch", lambda *a, **kw: windows.add(kw.get("window")) or launch(*a, **kw))
    monkeypatch.setattr(K, "gelu_tanh_and_mul", lambda *a, **kw: gelu_calls.append(1) or gelu(*a, **kw))
    llm = LLM(model_dir, attention_backend="triton", max_model_len=64, block_size=8,
              max_num_batched_tokens=16)  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=6),
                        use_tqdm=False)  # fmt: skip
    assert [o.outputs[0].token_ids for o in outs] == want
    arch = llm.config.model_config.arch
    assert windows == {arch.layer_window(i) for i in range(arch.num_layers)} == {16, None} and gelu_calls


def test_fp8_engine_on_the_fused_kernels_gives_the_reference_tokens(llama_dir):
    """`--quantization fp8` on the Triton path under the interpreter (norms and SiLU-and-
    multiply that quantize in their pass, `_scaled_mm` for prefill, the split-K kernel for the
    decode steps' few tokens) against the engine on the PyTorch reference ops: the same
    greedy tokens."""
    from llmserve import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [1] + list(range(40, 40 + n))} for n in (21, 7)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = LLM(llama_dir, attention_backend="triton", quantization="fp8", max_model_len=64, block_size=8)
    want = LLM(llama_dir, quantization="fp8", max_model_len=64, block_size=8)
    assert got.config.attention_backend == "triton"
    outs = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] for llm in (got, want)]
    assert outs[0] == outs[1]


def test_split_counts_are_powers_of_two_and_warmup_compiles_each():
    from llmserve.kernels import paged_attention as PA

    seen = {
        PA.choose_num_splits(tiles, kvh, seq, 132)
        for tiles in (1, 2, 3, 5, 7, 12, 40) for kvh in (1, 2, 8) for seq in (100, 700, 3000, 9000)
    }  # fmt: skip
    assert seen <= set(PA.split_counts()) and len(seen) > 2
    # one KV head with one query head: the interpreter runs every program of every launch one after
    # the other (a 128-token prefill split 32 ways is hundreds), and a wider GQA group only multiplies
    # the programs (4 heads over 2 KV heads: 52 s CPU, this 19 s); every split count is still launched
    kv_cache = torch.randn(2, 4, 4, 1, 16)
    before = kv_cache.clone()
    # handed to a pool (engine/warmup_pool.py): every launch is a unit of its own, three a split count
    # (run once here: each launch runs in the interpreter, and the inline path is the same launches)
    units = []
    count = PA.warmup_paged_attention(1, kv_cache, 0.25, max_batch=2, dtype=torch.float32, submit=units.append)
    assert count == len(units) == 3 * len(PA.split_counts())
    outs = [unit() for unit in reversed(units)]  # any order
    assert all(o.shape[-1] == 16 and torch.isfinite(o).all() for o in outs) and torch.equal(kv_cache, before)


# -- the sampler's kernels (llmserve/kernels/sampling.py) -----------------------------------
def _penalised_requests(vocab: int):
    from llmserve.engine.request import EngineCoreRequest, Request
    from llmserve.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(8)
    kinds = [dict(repetition_penalty=1.3), dict(presence_penalty=0.5), dict(frequency_penalty=0.4, presence_penalty=-0.2),
             dict(repetition_penalty=0.8, frequency_penalty=0.1), dict()]  # fmt: skip
    reqs = []
    for i, kind in enumerate(kinds):
        prompt = torch.randint(0, vocab, (5 + 40 * i,), generator=gen).tolist()
        req = Request(
            EngineCoreRequest(f"p{i}", prompt, SamplingParams(temperature=0, max_tokens=99, **kind), 99, (2,))
        )
        req.all_token_ids.extend(torch.randint(0, vocab, (30,), generator=gen).tolist() + prompt[:3])
        reqs.append(req)
    return reqs


@pytest.mark.parametrize("which", ["all", "repetition", "presence"])
def test_penalty_kernel_equals_the_tensor_ops_bit_for_bit(which):
    """Penalties in one pass against `PenaltyState.apply_tensors`: repetition over prompt and
    output, presence and frequency over the output, rows without a penalty untouched, a vocabulary
    that does not divide into blocks, -inf logits, both signs."""
    from llmserve.engine.penalty_state import PenaltyState

    vocab = 5003
    reqs = _penalised_requests(vocab)
    keep = {"all": range(5), "repetition": (0, 4), "presence": (1, 2, 4)}[which]
    reqs = [reqs[i] for i in keep]
    state = PenaltyState(vocab, torch.device("cpu"), use_kernel=True)
    pen = state.rows_for(reqs)
    state.count(torch.tensor([7] * len(reqs)), pen)  # a counted token on top of the filled rows
    logits = torch.randn(len(reqs) + 2, vocab, generator=torch.Generator().manual_seed(2)) * 3
    logits[:, 11] = float("-inf")
    want = state.apply_tensors(logits.clone(), pen)
    got = state.apply(logits.clone(), pen)
    assert torch.equal(got, want)
    assert not torch.equal(got[pen.rows], logits[pen.rows])  # (the penalties changed something)
    assert torch.equal(got[len(reqs) :], logits[len(reqs) :])


def test_the_sampler_on_its_kernels_equals_the_reference_step_after_step():
    """The batched sampler with its kernels (penalties; the race for rows that only have a
    temperature) against the one-request-at-a-time reference: the greedy and seeded rows give the
    reference's tokens, the unseeded ones valid tokens."""
    from test_sampler import MIXED, _run_steps

    from llmserve.engine.sampler import Sampler
    from llmserve.engine.sampler_reference import ReferenceSampler

    cpu = torch.device("cpu")
    got = _run_steps(Sampler(cpu, use_kernels=True), MIXED, 12, logprobs=True)
    want = _run_steps(ReferenceSampler(cpu), MIXED, 12, logprobs=True)
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, lps_got), (_, lps_want) in zip(got, want):  # (logprobs: rank and top k by logprob_stats.py)
        for a, b in zip(lps_got, lps_want):
            assert a.token_rank == b.token_rank and [i for i, _ in a.top] == [i for i, _ in b.top]
            assert a.token_logprob == pytest.approx(b.token_logprob, abs=1e-5)
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)
    half = [dict(s, logprobs=2) if i % 2 else s for i, s in enumerate(MIXED)]  # the kernel reads the asked rows only
    got, want = _run_steps(Sampler(cpu, use_kernels=True), half, 4), _run_steps(ReferenceSampler(cpu), half, 4)
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, lps_got), (_, lps_want) in zip(got, want):
        assert [a is None for a in lps_got] == [i % 2 == 0 for i in range(len(MIXED))]
        for a, b in zip(lps_got, lps_want):
            assert a == b or (
                a.token_rank == b.token_rank and a.token_logprob == pytest.approx(b.token_logprob, abs=1e-5)
            )
    plain = [
        dict(temperature=0.7, presence_penalty=0.5),
        dict(temperature=1.0, frequency_penalty=0.3),
        dict(temperature=0),
    ]
    tokens = [step[0] for step in _run_steps(Sampler(cpu, use_kernels=True), plain, 6)]
    assert all(0 <= t < 64 for step in tokens for t in step)
    assert [step[2] for step in tokens] == [step[0][2] for step in _run_steps(ReferenceSampler(cpu), plain, 6)]


def test_race_kernel_with_the_references_noise_picks_its_tokens():
    """Given the same Exp(1) noise, the kernel's winners are `exponential_race(logits / T, E)`'s:
    rows picked out of the batch, temperatures, masked tokens, and a tie (the first column wins)."""
    from llmserve.engine.sampler_reference import exponential_race
    from llmserve.kernels.sampling import RACE_BLOCK, race

    gen = torch.Generator().manual_seed(0)
    vocab = RACE_BLOCK + 904  # two blocks, the second partial
    logits = torch.randn(6, vocab, generator=gen) * 2
    logits[1, :3000] = float("-inf")
    rows, temperature = torch.tensor([0, 2, 5, 1]), torch.tensor([0.7, 1.0, 1.3, 0.5])
    noise = torch.empty(4, vocab).exponential_(generator=gen)
    want = exponential_race(logits[rows] / temperature[:, None], noise)
    assert torch.equal(race(logits, rows, temperature, noise=noise), want)
    assert torch.equal(
        race(logits, None, None, noise=noise.repeat(2, 1)[:6]), exponential_race(logits, noise.repeat(2, 1)[:6])
    )
    tie = torch.zeros(2, vocab)
    tie[:, [40, 1500, RACE_BLOCK + 7]] = 5.0  # in two quarters of the first block and in the second block
    assert race(tie, None, None, noise=torch.ones(2, vocab)).tolist() == [40, 40]
    tie[:, 40] = 0.0
    assert race(tie, None, None, noise=torch.ones(2, vocab)).tolist() == [1500, 1500]
    broken = torch.full((2, vocab), float("nan"))  # an overflowed row: a token of the vocabulary all the same
    broken[1, 7] = 1.0  # a NaN beside a real score loses to it
    assert race(broken, None, None, noise=torch.ones(2, vocab)).tolist() == [0, 7]


def test_race_kernel_draws_from_the_softmax():
    """With its own Philox noise: each token about as often as softmax(logits / T) says, a masked
    token never, the same tokens from the same generator seed and others from the next draw."""
    from llmserve.kernels.sampling import race

    row = torch.tensor([1.0, 2.0, 0.5, float("-inf"), 0.0, 1.5])
    x = row.repeat(300, 1)
    temperature = torch.full((300,), 0.8)
    tokens = race(x, None, temperature, generator=torch.Generator().manual_seed(1))
    freq = torch.bincount(tokens, minlength=6) / 300
    assert freq[3] == 0 and (freq - torch.softmax(row / 0.8, dim=-1)).abs().max() < 0.09
    few = (x[:40], None, temperature[:40])  # a row's noise depends on its seed and place alone
    assert torch.equal(tokens[:40], race(*few, generator=torch.Generator().manual_seed(1)))
    gen = torch.Generator().manual_seed(1)
    race(*few, generator=gen)
    assert not torch.equal(tokens[:40], race(*few, generator=gen))


def _filtered_reference(logits, rows, temperature, top_p, min_p, noise):
    """The reference's race over each row's top-p and min-p set (a sort of the vocabulary)."""
    from llmserve.engine.sampler_reference import apply_top_k_top_p_min_p, exponential_race

    part = logits[rows] / temperature[:, None]
    return exponential_race(apply_top_k_top_p_min_p(part, [0] * len(rows), top_p.tolist(), min_p.tolist()), noise)


def test_filtered_race_with_the_references_noise_picks_its_tokens():
    """Given the same noise, the race over each row's top-p / min-p set without a sort is the
    reference's: small top-p (the unrestricted winner mostly falls outside, so later passes
    decide), min-p alone and with top-p, neither, masked tokens, a vocabulary that does not divide
    into blocks, rows picked out of the batch and every row."""
    from llmserve.kernels.filtered_race import FILTER_BLOCK, filtered_race

    gen = torch.Generator().manual_seed(0)
    vocab = FILTER_BLOCK + 611
    logits = torch.randn(9, vocab, generator=gen) * 2.5
    logits[3, 100:2000] = float("-inf")
    rows = torch.tensor([0, 2, 5, 1, 3, 8, 7, 6])
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.5, 0.9, 1.0, 0.6, 1.1])
    top_p = torch.tensor([0.9, 0.05, 1.0, 0.3, 0.5, 1.0, 0.01, 0.7])
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.1, 0.0, 0.0, 0.0, 0.02])
    outside = 0
    for _trial in range(3):
        noise = torch.empty(len(rows), vocab).exponential_(generator=gen)
        want = _filtered_reference(logits, rows, temperature, top_p, min_p, noise)
        assert torch.equal(filtered_race(logits, rows, temperature, top_p, min_p, noise=noise), want)
        free = _filtered_reference(logits, rows, temperature, torch.ones(8), torch.zeros(8), noise)
        outside += int((free != want).sum())  # rows whose unrestricted winner was not kept
    assert outside >= 6
    every = torch.arange(9)
    ones, p = torch.ones(9), torch.full((9,), 0.4)
    noise = torch.empty(9, vocab).exponential_(generator=gen)
    got = filtered_race(logits, None, None, p, torch.zeros(9), noise=noise)
    assert torch.equal(got, _filtered_reference(logits, every, ones, p, torch.zeros(9), noise))


def test_filtered_race_keeps_a_tie_whole_and_survives_broken_rows():
    """Tokens of equal logit at the edge of the nucleus are kept together (the reference's
    `mass_above`); a NaN row and an all -inf row still give a token of the vocabulary."""
    from llmserve.engine.sampler_reference import apply_top_k_top_p_min_p
    from llmserve.kernels.filtered_race import filtered_race

    vocab = 300
    row = torch.full((vocab,), -4.0)
    row[[10, 20, 30]] = 2.0  # three tied tokens with most of the mass, then one above them
    row[5] = 3.0
    logits = row.repeat(2, 1)
    masked = apply_top_k_top_p_min_p(logits[:1], [0], [0.5], [0.0])
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [5, 10, 20, 30]
    noise = torch.ones(2, vocab)
    noise[:, 30] = 1e-6  # the last of the tie wins the race
    noise[:, 77] = 1e-30  # an untied token outside the nucleus would win without top-p
    got = filtered_race(logits, None, None, torch.tensor([0.5, 0.5]), torch.zeros(2), noise=noise)
    assert got.tolist() == [30, 30]
    broken = torch.full((2, vocab), float("nan"))
    broken[1] = float("-inf")
    got = filtered_race(
        broken, None, None, torch.tensor([0.9, 0.9]), torch.tensor([0.1, 0.0]), noise=torch.ones(2, vocab)
    )
    assert got.tolist() == [0, 0]


def test_filtered_race_hashes_seeded_rows_as_seeded_noise_does():
    """Seeded rows draw `seeded_noise.exponential` at their keys inside the kernel (the reference's
    tokens); unseeded rows beside them draw from the nucleus, renormalised."""
    from llmserve.engine import seeded_noise
    from llmserve.kernels.filtered_race import filtered_race

    gen = torch.Generator().manual_seed(4)
    vocab = 3000
    logits = torch.randn(5, vocab, generator=gen) * 3
    temperature = torch.tensor([0.8, 1.0, 1.2, 0.7, 1.0])
    top_p, min_p = torch.tensor([0.6, 1.0, 0.2, 0.9, 0.5]), torch.tensor([0.0, 0.05, 0.0, 0.0, 0.0])
    keys = torch.tensor([seeded_noise.row_key(7, 0), seeded_noise.row_key(2**64 - 1, 41), seeded_noise.row_key(3, 2)])
    slots = torch.tensor([2, -1, 0, 1, -1], dtype=torch.int32)
    got = filtered_race(
        logits, None, temperature, top_p, min_p, slots, keys, generator=torch.Generator().manual_seed(1)
    )
    for j, slot in enumerate(slots.tolist()):
        if slot >= 0:
            noise = seeded_noise.exponential(keys[slot : slot + 1], torch.arange(vocab))
            want = _filtered_reference(
                logits, torch.tensor([j]), temperature[j : j + 1], top_p[j : j + 1], min_p[j : j + 1], noise
            )
            assert got[j] == want[0], j
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")])
    x = row.repeat(400, 1)
    tokens = filtered_race(
        x, None, None, torch.full((400,), 0.8), torch.zeros(400), generator=torch.Generator().manual_seed(2)
    )
    probs = torch.softmax(row, dim=-1)  # nucleus at 0.8: tokens 0-2 (the mass above token 3 is 0.90)
    nucleus = probs[:3] / probs[:3].sum()
    freq = torch.bincount(tokens, minlength=6).float() / 400
    assert freq[3:].sum() == 0 and (freq[:3] - nucleus).abs().max() < 0.08


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprob_stats_kernel_equals_the_tensor_ops(dtype):
    """A sampled token's logprob and rank and the top k in one pass over the raw logits: the
    values of `log_softmax` (to float32 rounding), the ranks of `(lp > token's).sum() + 1` and the
    ids of `topk`, over rows that span blocks (the best of a row in several blocks, a vocabulary
    that does not divide), k from 1 to 20, a masked token, 16-bit logits, and rows picked out of
    the batch (the others never read: NaN there)."""
    from llmserve.kernels.logprob_stats import STATS_BLOCK, logprob_stats

    gen = torch.Generator().manual_seed(5)
    vocab = 2 * STATS_BLOCK + 333
    logits = (torch.randn(5, vocab, generator=gen) * 3).to(dtype)
    logits[2, 17] = float("-inf")
    logits[1, [5, STATS_BLOCK + 9, 2 * STATS_BLOCK + 300]] = logits[1].max() + torch.tensor([3.0, 2.0, 1.0]).to(dtype)
    logits[3] = float("nan")  # not asked
    lp = torch.log_softmax(logits.float(), dim=-1)
    rows = torch.tensor([0, 1, 2, 4])
    tokens = torch.tensor([0, STATS_BLOCK + 9, 17, vocab - 1])
    want_lp = lp[rows, tokens]
    for k in (1, 5, 20):
        token_lp, rank, values, ids = logprob_stats(logits, tokens, k, rows)
        want_v, want_i = lp[rows].topk(k, dim=-1)
        assert (
            torch.allclose(token_lp[[0, 1, 3]], want_lp[[0, 1, 3]], rtol=1e-6, atol=1e-5) and token_lp[2] == -math.inf
        )
        assert torch.equal(rank, (lp[rows] > want_lp[:, None]).sum(dim=-1) + 1)
        assert torch.allclose(values, want_v, rtol=1e-6, atol=1e-5)
        if dtype == torch.float32:
            assert torch.equal(ids, want_i)
        else:  # 16-bit logits tie: any of the tied ids, each once
            assert torch.equal(lp[rows].gather(-1, ids), want_v) and all(len(set(r)) == k for r in ids.tolist())
    assert ids[1, :3].tolist() == [5, STATS_BLOCK + 9, 2 * STATS_BLOCK + 300] and rank[1] == 2
    whole = logprob_stats(logits[rows], tokens, 5)  # every row of its batch
    assert all(torch.equal(a, b) for a, b in zip(whole, logprob_stats(logits, tokens, 5, rows)))
