"""The fused MoE kernels (kernels/fused_moe.py) against the PyTorch reference (model/moe.py), on CPU
under the Triton interpreter, float32 with tight tolerances.

Shapes are tiny (the interpreter runs every program in Python) but cover: E = 4, 8, 16, 64; top_k
1, 2, 4, 8 (k = E too); 1 token and a few dozen; tokens where most experts get none; widths that
are not multiples of the tiles; each default tile bucket's BLOCK_M; renormalised or not; the align
step's sorted rows and block experts; the Qwen2-MoE shared expert beside the fused routed experts.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton or llmserve.kernels is imported

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

if not isinstance(triton.language.standard.cdiv, InterpretedFunction):
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; run this file in its own process",
                allow_module_level=True)  # fmt: skip

from llmserve.kernels import fused_moe as fm  # noqa: E402
from llmserve.model.moe import (  # noqa: E402
    experts_reference,
    fused_moe_reference,
    moe_block_reference,
    route_reference,
    shared_expert_reference,
)

pytestmark = pytest.mark.unit

TOL = dict(atol=2e-6, rtol=2e-5)


def _weights(num_experts: int, hidden: int, inter: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    return w13, w2


@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, inter, renormalize",
    [
        (1, 8, 2, 64, 32, True),  # one decode token: two blocks, six experts unread
        (5, 4, 1, 48, 40, False),  # top-1, widths off the tile grid
        (3, 64, 2, 32, 16, True),  # six rows over 64 experts: most get none
        (7, 8, 8, 32, 24, False),  # k = E: every expert, every token
        (37, 16, 4, 64, 96, True),  # a prefill's worth: several full blocks per expert
    ],
)  # fmt: skip
def test_fused_moe_equals_the_reference(tokens, experts, top_k, hidden, inter, renormalize):
    gen = torch.Generator().manual_seed(tokens * 1000 + experts)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    w13, w2 = _weights(experts, hidden, inter, gen)
    weights, ids = fm.route(logits, top_k, renormalize)
    ref_weights, ref_ids = route_reference(logits, top_k, renormalize)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-6)
    out = fm.fused_moe(x, logits, w13, w2, top_k, renormalize)
    torch.testing.assert_close(out, fused_moe_reference(x, logits, w13, w2, top_k, renormalize), **TOL)


@pytest.mark.parametrize("bucket", sorted(fm.DEFAULT_TILES))
def test_every_default_tile_bucket(bucket):
    """Each bucket's tiles (BLOCK_M 16 to 64, BLOCK_N up to 128) on the same rows, a few of which
    land on an expert alone (a block mostly padding)."""
    gen = torch.Generator().manual_seed(7)
    tokens, experts, top_k, hidden, inter = 9, 8, 2, 40, 72
    x = torch.randn(tokens, hidden, generator=gen)
    w13, w2 = _weights(experts, hidden, inter, gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    out = fm.fused_experts(x, w13, w2, weights, ids, tiles=fm.DEFAULT_TILES[bucket])
    torch.testing.assert_close(out, experts_reference(x, w13, w2, weights, ids.long()), **TOL)


def test_align_groups_rows_by_expert_in_padded_blocks():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [5, 3]], dtype=torch.int32)  # rows 0..7, E = 6
    sorted_rows, block_expert, num_padded = fm.align(ids, 6, 4)
    n = ids.numel()
    assert num_padded.item() == 16  # experts 0, 1, 3, 5: one block of 4 each
    assert block_expert.tolist()[:4] == [0, 1, 3, 5] and set(block_expert.tolist()[4:]) == {-1}
    runs = sorted_rows[:16].view(4, 4).tolist()
    assert runs == [[1, 4, n, n], [3, n, n, n], [0, 2, 5, 7], [6, n, n, n]]  # row order kept inside a run
    assert len(block_expert) == fm.max_blocks(n, 6, 4)


def test_route_picks_the_top_k_by_probability_and_renormalises():
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0], [5.0, 4.0, 3.0, -2.0]])
    weights, ids = fm.route(logits, 2, True)
    assert ids.tolist() == [[1, 3], [0, 1]]
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    plain, _ = fm.route(logits, 2, False)
    torch.testing.assert_close(plain, F.softmax(logits, -1).gather(1, ids.long()))


def test_tile_config_buckets_and_tuned_tables(monkeypatch):
    assert fm.tile_config(1, 8, 64, 32) == fm.DEFAULT_TILES[32]
    assert fm.tile_config(33, 8, 64, 32) == fm.DEFAULT_TILES[256]
    assert fm.tile_config(10**9 + 7, 8, 64, 32) == fm.DEFAULT_TILES[max(fm.DEFAULT_TILES)]
    tuned = {64: dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=2, num_stages=2)}
    monkeypatch.setitem(fm.TUNED_TILES, fm.shape_key(8, 64, 32), tuned)
    assert fm.shape_key(8, 64, 32) == "8,64,32"
    assert fm.tile_config(100, 8, 64, 32) == tuned[64]  # past the last bucket: the last
    assert fm.tile_config(100, 8, 64, 48) == fm.DEFAULT_TILES[256]  # another shape: the defaults


def test_the_shared_expert_block_and_no_tokens():
    gen = torch.Generator().manual_seed(3)
    tokens, experts, hidden, inter, shared_inter = 6, 8, 32, 16, 48
    x = torch.randn(tokens, hidden, generator=gen)
    router = torch.randn(experts, hidden, generator=gen)
    w13, w2 = _weights(experts, hidden, inter, gen)
    shared = (torch.randn(2 * shared_inter, hidden, generator=gen) * 0.2, torch.randn(hidden, shared_inter, generator=gen)
              * 0.2, torch.randn(1, hidden, generator=gen))  # fmt: skip
    fused = fm.fused_moe(x, F.linear(x, router), w13, w2, 2, False) + shared_expert_reference(x, *shared)
    torch.testing.assert_close(fused, moe_block_reference(x, router, w13, w2, 2, False, shared), **TOL)
    empty = fm.fused_moe(x[:0], F.linear(x[:0], router), w13, w2, 2, False)
    assert empty.shape == (0, hidden)


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_shares_add_up_to_the_whole(world):
    """Expert parallelism: each rank holds E / world whole experts and routes every token; its share
    (rows routed to other ranks' experts add 0: id -1, in no block of the kernel's) summed over the
    ranks is the whole block's output, in the reference and in the kernels."""
    gen = torch.Generator().manual_seed(world)
    tokens, experts, top_k, hidden, inter = 19, 8, 2, 32, 24
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    w13, w2 = _weights(experts, hidden, inter, gen)
    whole = fused_moe_reference(x, logits, w13, w2, top_k, True)
    per = experts // world
    shares = [(r * per, w13[r * per : (r + 1) * per], w2[r * per : (r + 1) * per]) for r in range(world)]
    ref = sum(fused_moe_reference(x, logits, a, b, top_k, True, first_expert=f) for f, a, b in shares)
    torch.testing.assert_close(ref, whole, **TOL)
    fused = sum(fm.fused_moe(x, logits, a, b, top_k, True, first_expert=f) for f, a, b in shares)
    torch.testing.assert_close(fused, whole, **TOL)


def _fp8_experts(w13: torch.Tensor, w2: torch.Tensor, block_shape: tuple[int, int] | None):
    """The experts in FP8 with scales per output channel, or per block: (q13, q2, scales as kwargs)."""
    from llmserve.model.fp8 import quantize_rows
    from llmserve.model.fp8_blocks import quantize_blocks

    if block_shape is not None:
        (q13, s13), (q2, s2) = quantize_blocks(w13, block_shape), quantize_blocks(w2, block_shape)
        return q13, q2, dict(w13_scale=s13, w2_scale=s2, block_shape=block_shape)
    experts, two_i, hidden = w13.shape
    q13, s13 = quantize_rows(w13.reshape(-1, hidden))
    q2, s2 = quantize_rows(w2.reshape(-1, two_i // 2))
    return (q13.reshape(w13.shape), q2.reshape(w2.shape),
            dict(w13_scale=s13.reshape(experts, two_i, 1), w2_scale=s2.reshape(experts, hidden, 1)))  # fmt: skip


def test_fp8_experts_reference_is_close_to_the_float32_one():
    """FP8 experts (weights per output channel or per block, tokens and SiLU-and-mul rows per token,
    E4M3) stay within FP8's rounding of the float32 block."""
    gen = torch.Generator().manual_seed(7)
    tokens, experts, top_k, hidden, inter = 23, 8, 2, 64, 48
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    w13, w2 = _weights(experts, hidden, inter, gen)
    exact = fused_moe_reference(x, logits, w13, w2, top_k, True)
    for block_shape in (None, (16, 32)):
        q13, q2, scales = _fp8_experts(w13, w2, block_shape)
        got = fused_moe_reference(x, logits, q13, q2, top_k, True, **scales)
        # E4M3 keeps 3 mantissa bits: ~2.5 % on each of x, the weights, the SiLU-and-mul rows and w2
        assert (got - exact).norm() / exact.norm() < 0.08
        assert not torch.equal(got, exact)


@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, inter, block_shape, dtype",
    [
        (1, 8, 2, 64, 32, None, torch.float32),  # a decode token, scales per channel
        (37, 16, 4, 64, 96, None, torch.float32),  # a prefill's worth
        (5, 8, 2, 64, 48, (16, 32), torch.float32),  # blocks: K steps cut to 32, partial last K block of down
        (29, 8, 2, 96, 64, (32, 64), torch.float32),  # 1.5 K blocks of gate/up, BLOCK_N 64 over two N blocks
        (11, 8, 2, 128, 128, (128, 128), torch.bfloat16),  # Qwen3-30B-A3B-FP8's blocks, bf16 tokens
    ],
)  # fmt: skip
def test_fp8_fused_moe_equals_the_fp8_reference(tokens, experts, top_k, hidden, inter, block_shape, dtype):
    """The fused kernels on FP8 experts (per channel: scales after the K loop; per block: each K
    step's product scaled) against the FP8 reference, and within FP8's rounding of the float32
    experts. The SiLU-and-mul rows are quantized from the kernel's float32 sums, which may round a
    rare element to the next E4M3 value: a few ulps of float32 apart at most, so the tolerance is
    that of one such element, far under FP8's own error (checked beside it)."""
    gen = torch.Generator().manual_seed(tokens * 100 + hidden)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    w13, w2 = _weights(experts, hidden, inter, gen)
    q13, q2, scales = _fp8_experts(w13, w2, block_shape)
    ref = fused_moe_reference(x, logits, q13, q2, top_k, True, **scales)
    out = fm.fused_moe(x, logits, q13, q2, top_k, True, **scales)
    assert out.dtype == dtype
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, ref, **tol)
    exact = fused_moe_reference(x.float(), logits, w13, w2, top_k, True)
    assert (out.float() - exact).norm() / exact.norm() < 0.08


@pytest.mark.parametrize("bucket", [32, 1 << 30])
def test_fp8_fused_moe_every_tile_shape_and_expert_parallel(bucket):
    """FP8 per-block experts under the smallest and largest default tiles (BLOCK_N 128 spans four
    16-row scale blocks), and an expert-parallel rank's share (the other experts' rows add 0)."""
    gen = torch.Generator().manual_seed(bucket % 97)
    tokens, experts, top_k, hidden, inter = 9, 8, 2, 64, 64
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    w13, w2 = _weights(experts, hidden, inter, gen)
    q13, q2, scales = _fp8_experts(w13, w2, (16, 32))
    ref = fused_moe_reference(x, logits, q13, q2, top_k, True, **scales)
    out = fm.fused_moe(x, logits, q13, q2, top_k, True, tiles=fm.DEFAULT_TILES[bucket], **scales)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    half = dict(w13_scale=scales["w13_scale"][4:], w2_scale=scales["w2_scale"][4:], block_shape=(16, 32))
    share = fm.fused_moe(x, logits, q13[4:], q2[4:], top_k, True, first_expert=4, **half)
    torch.testing.assert_close(share, fused_moe_reference(x, logits, q13[4:], q2[4:], top_k, True, first_expert=4,
                                                          **half), atol=2e-3, rtol=2e-3)  # fmt: skip
    assert share.abs().sum() > 0 and not torch.allclose(share, ref)


@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, inter",
    [
        (1, 8, 2, 64, 32),  # one decode token: the default choice
        (3, 64, 2, 48, 40),  # three tokens, widths off the tiles (BLOCK_N 32, BLOCK_K 128 > H)
        (2, 4, 4, 160, 72),  # k = E: both tokens read every expert; H over two K steps
    ],
)  # fmt: skip
def test_the_decode_variant_equals_the_reference_and_the_grouped_kernels(tokens, experts, top_k, hidden, inter):
    """The decode variant (GEMVs over the (token, slot) rows, the sum in the down kernel) against the
    reference and the grouped kernels on the same rows; the rule picks it at one token only."""
    gen = torch.Generator().manual_seed(tokens * 31 + experts)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    w13, w2 = _weights(experts, hidden, inter, gen)
    ref = fused_moe_reference(x, logits, w13, w2, top_k, True)
    decoded = fm.fused_moe(x, logits, w13, w2, top_k, True, decode=True)
    torch.testing.assert_close(decoded, ref, **TOL)
    torch.testing.assert_close(fm.fused_moe(x, logits, w13, w2, top_k, True, decode=False), ref, **TOL)
    assert fm.use_decode(tokens, experts, hidden, inter) == (tokens == 1)
    assert torch.equal(fm.fused_moe(x, logits, w13, w2, top_k, True), decoded if tokens == 1 else
                       fm.fused_moe(x, logits, w13, w2, top_k, True, decode=False))  # fmt: skip


def test_the_decode_variant_under_expert_parallelism_and_in_bf16():
    """A rank's share (ids -1 read nothing and add 0) and bf16 rows: each slot's row is rounded to
    bf16 before the sum, as the grouped kernels store it (whose bf16 tl.dot the interpreter does
    not compute: they are compared on the GPU, tests/gpu/test_gpu_moe.py), within bf16's rounding
    of the float32 math on the same bf16 inputs."""
    gen = torch.Generator().manual_seed(5)
    tokens, experts, top_k, hidden, inter = 2, 8, 2, 64, 48
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    w13, w2 = _weights(experts, hidden, inter, gen)
    share = fm.fused_moe(x, logits, w13[4:], w2[4:], top_k, True, first_expert=4, decode=True)
    want = fused_moe_reference(x, logits, w13[4:], w2[4:], top_k, True, first_expert=4)
    torch.testing.assert_close(share, want, **TOL)
    other = fm.fused_moe(x, logits, w13[:4], w2[:4], top_k, True, first_expert=0, decode=True)
    torch.testing.assert_close(share + other, fused_moe_reference(x, logits, w13, w2, top_k, True), **TOL)
    xb, lb, w13b, w2b = (t.to(torch.bfloat16) for t in (x, logits, w13, w2))
    got = fm.fused_moe(xb, lb, w13b, w2b, top_k, True, decode=True)
    assert got.dtype == torch.bfloat16
    want = fused_moe_reference(*(t.float() for t in (xb, lb, w13b, w2b)), top_k, True)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("block_shape, dtype", [(None, torch.float32), ((16, 32), torch.float32),
                                                ((128, 128), torch.bfloat16)])  # fmt: skip
def test_the_decode_variant_on_fp8_experts(block_shape, dtype):
    """FP8 experts through the decode variant (scales per channel after the loop; per block each K
    step's product, BLOCK_K cut to the scale block) against the FP8 reference."""
    gen = torch.Generator().manual_seed(11)
    wide = block_shape == (128, 128)  # Qwen3-30B-A3B-FP8's blocks: one K step of 128
    tokens, experts, top_k, hidden, inter = 2, 8, 2, (128 if wide else 64), (128 if wide else 64)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    w13, w2 = _weights(experts, hidden, inter, gen)
    q13, q2, scales = _fp8_experts(w13, w2, block_shape)
    ref = fused_moe_reference(x, logits, q13, q2, top_k, True, **scales)
    out = fm.fused_moe(x, logits, q13, q2, top_k, True, decode=True, **scales)
    assert out.dtype == dtype
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, ref, **tol)


def test_decode_settings_are_data(monkeypatch):
    assert fm.decode_config(8, 64, 32) == fm.DEFAULT_DECODE and fm.DEFAULT_DECODE["max_tokens"] == 1
    assert not fm.use_decode(0, 8, 64, 32) and fm.use_decode(1, 8, 64, 32) and not fm.use_decode(2, 8, 64, 32)
    tuned = dict(fm.DEFAULT_DECODE, max_tokens=4, BLOCK_N=16)
    monkeypatch.setitem(fm.TUNED_DECODE, fm.shape_key(8, 64, 32), tuned)
    assert fm.use_decode(4, 8, 64, 32) and not fm.use_decode(5, 8, 64, 32)
    assert not fm.use_decode(4, 8, 64, 48)  # another shape: the default rule
    monkeypatch.setitem(fm.TUNED_DECODE, fm.shape_key(8, 64, 32), dict(tuned, max_tokens=0))
    assert not any(fm.use_decode(t, 8, 64, 32) for t in range(0, 9))  # 0: the variant never wins
