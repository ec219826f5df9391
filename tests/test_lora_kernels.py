"""The batched LoRA Triton kernels (shrink, expand) against their PyTorch references, on CPU
under the Triton interpreter; then the whole tiny model with LoRA through the kernels.

Its own module because TRITON_INTERPRET=1 must be set before triton is first imported (as in
tests/test_kernels.py). Covered: mixed batches (tokens of several slots interleaved, tokens
without an adapter, a slot with no token, padding rows past the step's tokens), more tokens
of one slot than a row block, ranks below the padded maximum, 1/2/3 output slices of
unequal widths, an input size that is not a multiple of the K block, float32 and float16.
No bfloat16 case: the interpreter's bf16 `tl.dot` multiplies raw bit patterns (as
tests/test_kernels.py notes); bf16 is for a GPU run.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton or llmserve.kernels is imported

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

if not isinstance(triton.language.standard.cdiv, InterpretedFunction):
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; run tests/test_lora_kernels.py "
                "in its own process", allow_module_level=True)  # fmt: skip

from llmserve.kernels.lora import lora_expand, lora_shrink  # noqa: E402
from llmserve.lora.context import LoRAContext  # noqa: E402
from llmserve.lora.reference import lora_expand_reference, lora_shrink_reference  # noqa: E402

pytestmark = pytest.mark.unit

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)}


def make_slots(num_slots: int, slices: int, max_rank: int, in_features: int, widths: list[int], dtype: torch.dtype,
               gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Stacked A [S, J, R, in] and B [S, out, R] with slot s of rank max_rank >> s (zero-padded),
    and a scaling per slot."""
    a = torch.zeros(num_slots, slices, max_rank, in_features)
    b = torch.zeros(num_slots, sum(widths), max_rank)
    for s in range(num_slots):
        rank = max(1, max_rank >> s)
        a[s, :, :rank] = torch.randn(slices, rank, in_features, generator=gen) / in_features**0.5
        b[s, :, :rank] = torch.randn(sum(widths), rank, generator=gen) / rank**0.5
    scaling = torch.rand(num_slots, generator=gen) + 0.5
    return a.to(dtype), b.to(dtype), scaling


def offsets(widths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(widths).cumsum(0).tolist()], dtype=torch.int32)


CASES = [  # (token slots, in_features, max_rank, slice widths)
    ([0, 1, -1, 2, 1, 0, 0, -1, 2], 64, 16, [64, 32, 32]),  # qkv-like: q wider than k, v
    ([1] * 20 + [-1, 0] * 3, 72, 8, [48]),  # 20 tokens of one slot: two row blocks; rank 8 padded to 16
    ([2, 2, -1, -1], 40, 32, [24, 24]),  # gate/up-like; slots 0 and 1 have no token
    ([-1, -1, -1], 64, 16, [64]),  # no adapter at all: nothing changes
    ([0] * 40 + [1, -1] * 15 + [2] * 3, 48, 16, [160, 96]),  # 75 rows: row blocks of 64, column blocks of 128
]


@pytest.mark.parametrize("splits", [None, 3])  # None: the token-count default (1 here: K is small)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_shrink_and_expand_match_the_reference(case, dtype, splits):
    token_slots, in_features, max_rank, widths = CASES[case]
    gen = torch.Generator().manual_seed(case)
    a, b, scaling = make_slots(3, len(widths), max_rank, in_features, widths, dtype, gen)
    num_tokens = len(token_slots) + 2  # two padding rows, as a captured CUDA graph would have
    ctx = LoRAContext(max_num_tokens=128, num_slots=3)
    ctx.set_token_slots(token_slots)
    batch = ctx.batch(num_tokens)
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    t = lora_shrink(x, a, scaling, batch, block_k=16, splits=splits)  # K of 40-72: 3 splits of 16-32
    assert (t.shape[0] > 1) == (splits is not None)  # 2 or 3 parts: no part is left empty
    t_ref = lora_shrink_reference(x, a, scaling, batch)
    adapter_rows = torch.tensor([s >= 0 for s in token_slots] + [False, False])  # the others are not written
    torch.testing.assert_close(t.sum(0)[adapter_rows], t_ref[adapter_rows], **TOL[torch.float32])
    y0 = torch.randn(num_tokens, sum(widths), generator=gen).to(dtype)
    y, y_ref, y_split = y0.clone(), y0.clone(), y0.clone()
    lora_expand(y, t_ref, b, offsets(widths), max(widths), batch)
    lora_expand_reference(y_ref, t_ref, b, offsets(widths), max(widths), batch)
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    lora_expand(y_split, t, b, offsets(widths), max(widths), batch)  # the shrink's own partial sums
    torch.testing.assert_close(y_split, y_ref, **TOL[dtype])
    untouched = ~adapter_rows  # tokens without an adapter, and padding
    assert torch.equal(y[untouched], y0[untouched]) and torch.equal(y_split[untouched], y0[untouched])
    if any(s >= 0 for s in token_slots):
        assert not torch.equal(y, y0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_gemm_expand_matches_the_reference(case, dtype):
    """lora_expand_gemm (one dense GEMM per slice over every slot's B) against the reference,
    fed the shrink's partial sums whose rows without an adapter hold garbage (NaN here)."""
    from llmserve.lora.expand_gemm import lora_expand_gemm
    from llmserve.lora.slot_weights import ProjectionLoRA

    token_slots, in_features, max_rank, widths = CASES[case]
    gen = torch.Generator().manual_seed(100 + case)
    a, b, scaling = make_slots(3, len(widths), max_rank, in_features, widths, torch.float32, gen)
    num_tokens = len(token_slots) + 2
    ctx = LoRAContext(max_num_tokens=128, num_slots=3)
    ctx.set_token_slots(token_slots)
    batch = ctx.batch(num_tokens)
    x = torch.randn(num_tokens, in_features, generator=gen)
    t_ref = lora_shrink_reference(x, a, scaling, batch)
    parts = torch.stack([t_ref * 0.25, t_ref * 0.75])  # as the split shrink hands them over
    no_adapter = torch.tensor([s < 0 for s in token_slots] + [True, True])
    parts[:, no_adapter] = float("nan")  # never written by the shrink
    b_store = b.to(dtype).permute(1, 0, 2).contiguous().permute(1, 0, 2)  # the store's layout: b_all is a view
    lora = ProjectionLoRA(a, b_store, scaling, offsets(widths), max(widths), tuple(offsets(widths).tolist()))
    assert lora.b_all.data_ptr() == b_store.data_ptr()
    y0 = torch.randn(num_tokens, sum(widths), generator=gen).to(dtype)
    y, y_ref = y0.clone(), y0.clone()
    lora_expand_gemm(y, parts, lora.b_all, lora.slice_bounds, batch)
    lora_expand_reference(y_ref, t_ref, b_store, lora.slice_offsets, max(widths), batch)
    torch.testing.assert_close(y, y_ref, **({"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}))
    assert torch.equal(y[no_adapter], y0[no_adapter])


def test_shrink_splits_follow_the_token_count():
    from llmserve.kernels.lora import shrink_splits

    assert shrink_splits(1, 3, 4096) == 16 and shrink_splits(1, 1, 14336) == 56  # decode: K shared out
    assert shrink_splits(512, 3, 4096) == 5  # 8 row blocks of 64
    assert shrink_splits(16384, 3, 4096) == 1 and shrink_splits(1, 1, 64) == 1  # enough programs; tiny K


def test_empty_batch():
    ctx = LoRAContext(max_num_tokens=4, num_slots=2)
    ctx.clear()
    a, b, scaling = make_slots(2, 1, 16, 32, [32], torch.float32, torch.Generator().manual_seed(0))
    t = lora_shrink(torch.zeros(0, 32), a, scaling, ctx.batch(0))
    assert t.shape[1:] == (0, 1, 16)
    lora_expand(torch.zeros(0, 32), t, b, offsets([32]), 32, ctx.batch(0))


class _NoStream:
    """A stand-in for the second CUDA stream on the CPU: the overlapped path runs in order."""

    def wait_stream(self, other) -> None:
        pass


def test_the_model_with_lora_kernels_equals_the_reference_ops(tmp_path, monkeypatch):
    """The tiny Llama with two adapters in its slots, one flat batch (two adapters, the base):
    the same logits through the Triton kernels as through the PyTorch references; and the
    overlapped path (a stand-in stream on the CPU: q/k/v's delta added by its own add, the others'
    by the op after the projection, lora/deferred.py) gives the references' logits bit for bit."""
    import contextlib
    import dataclasses

    from llmserve.lora import (
        REFERENCE_LORA_OPS,
        LoRAAdapter,
        LoRAModuleWeights,
        LoRASlotStore,
        apply_lora,
        triton_lora_ops,
    )
    from llmserve.lora.deferred import ActAddingDelta, NormAddingDelta
    from llmserve.lora.projections import module_shapes
    from llmserve.model.arch import read_model_arch
    from llmserve.model.attention import AttentionMetadata, reference_paged_attention
    from llmserve.model.loader import load_model
    from llmserve.model.random_model import make_random_model

    model_dir = make_random_model(tmp_path / "m", "llama", config_only=True)  # dummy weights: no transformers model
    arch = read_model_arch(model_dir)
    gen = torch.Generator().manual_seed(1)
    adapters = [LoRAAdapter(f"a{rank}", "", rank, 2.0, {
        (layer, m): LoRAModuleWeights(torch.randn(rank, i, generator=gen) / i**0.5, torch.randn(o, rank, generator=gen) / 4)
        for layer in range(arch.num_layers) for m, (i, o) in module_shapes(arch).items()}) for rank in (4, 16)]  # fmt: skip
    ids = torch.randint(3, arch.vocab_size, (12,), generator=gen)
    token_slots = [0] * 5 + [-1] * 3 + [1] * 4  # three sequences: 5, 3 and 4 tokens
    meta = AttentionMetadata(torch.cat([torch.arange(5), 16 + torch.arange(3), 32 + torch.arange(4)]),
                             torch.tensor([0, 5, 8, 12], dtype=torch.int32), torch.tensor([5, 3, 4], dtype=torch.int32),
                             torch.arange(3, dtype=torch.int32)[:, None], 5, 5)  # fmt: skip
    positions = torch.cat([torch.arange(5), torch.arange(3), torch.arange(4)])
    logits = []
    # the references; the kernels; the kernels with the GEMM expand for every step (B output-major);
    # the default's mix: the GEMM expand in the widest projection (gate/up) only, the Triton expand
    # reading the output-major B in the others
    from llmserve.lora.projections import projection_specs

    widest = max(spec.out_features for spec in projection_specs(arch))
    overlapped = dataclasses.replace(REFERENCE_LORA_OPS, overlap_max_tokens=16)
    variants = ((None, False), (triton_lora_ops(), False), (triton_lora_ops(1, gemm_expand_min_width=1), True),
                (triton_lora_ops(1, gemm_expand_min_width=widest), True),
                (triton_lora_ops(overlap_max_tokens=16), False),  # deferred adds, through the kernels
                (overlapped, False))  # fmt: skip
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _NoStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    for ops, output_major in variants:
        model = load_model(str(model_dir), arch, torch.float32, "cpu", reference_paged_attention, load_format="dummy",
                           progress=False)  # fmt: skip
        store = LoRASlotStore(arch, num_slots=2, max_rank=16, output_major_b=output_major)
        ctx = LoRAContext(max_num_tokens=16, num_slots=2)
        overlap = ops is not None and ops.overlap_max_tokens > 0
        applied = apply_lora(model, store, ctx, *([ops] if ops else []), side=_NoStream() if overlap else None)
        wrappers = [m for layer in model.model.layers for m in (layer.input_layernorm, layer.post_attention_layernorm,
                                                                layer.mlp.act)] + [model.model.norm]  # fmt: skip
        deferred = overlap
        # the op after every o, gate/up and down: 2 norms a layer (the first layer's input norm follows no
        # projection; the final norm follows the last down) and the activation
        assert sum(isinstance(m, NormAddingDelta) for m in wrappers) == (2 * arch.num_layers if deferred else 0)
        assert sum(isinstance(m, ActAddingDelta) for m in wrappers) == (arch.num_layers if deferred else 0)
        assert model.model.norm.weight.dtype == torch.float32  # (the piecewise graphs read it: a wrapper passes it on)
        for adapter in adapters:
            store.load(adapter)
        ctx.set_token_slots(token_slots)
        for layer in model.attention_layers():
            layer.kv_cache = torch.zeros(2, 3, 16, arch.num_kv_heads, arch.head_dim)
        with torch.inference_mode():
            logits.append(model.compute_logits(model(ids, positions, meta)))
        if deferred:  # the piecewise graphs' pieces (run eagerly here) read the wrapped norm and keep each
            # producer with its consumer in one piece: the same logits
            from llmserve.engine.cuda_graphs import PiecewiseGraphs

            pieces = PiecewiseGraphs(model, 16, torch.device("cpu"))
            with torch.inference_mode():
                torch.testing.assert_close(model.compute_logits(pieces.run(ids, positions, meta)), logits[-1],
                                           rtol=1e-5, atol=1e-5)  # fmt: skip
    applied.remove()  # (the last variant deferred its adds: the norms and activations are back too)
    assert not any(isinstance(m, (NormAddingDelta, ActAddingDelta)) for layer in model.model.layers
                   for m in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp.act, model.model.norm))  # fmt: skip
    ctx.set_token_slots([-1] * 12)  # the same batch on the base model alone
    for layer in model.attention_layers():
        layer.kv_cache.zero_()
    with torch.inference_mode():
        base = model.compute_logits(model(ids, positions, meta))
    with_adapter = torch.tensor(token_slots) >= 0
    assert torch.equal(base[~with_adapter], logits[1][~with_adapter])
    assert (base[with_adapter] - logits[1][with_adapter]).abs().amax(-1).min() > 1e-3
    for fast in logits[1:]:
        torch.testing.assert_close(fast, logits[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(fast.argmax(-1), logits[0].argmax(-1))
    assert torch.equal(logits[-1], logits[0])  # the references, overlapped


def test_b_is_output_major_only_where_a_projection_takes_the_gemm_expand(tmp_path, monkeypatch):
    """RunnerLoRA stores B output-major (and lets the GEMM expand run) only if some projection of
    the model is at least GEMM_EXPAND_MIN_WIDTH wide; else the slot-major layout, Triton only."""
    from llmserve.config import LoRAConfig
    from llmserve.engine import lora_runner
    from llmserve.lora.projections import projection_specs
    from llmserve.model.arch import read_model_arch
    from llmserve.model.attention import reference_paged_attention
    from llmserve.model.loader import load_model
    from llmserve.model.random_model import make_random_model

    model_dir = make_random_model(tmp_path / "m", "llama", config_only=True)
    arch = read_model_arch(model_dir)
    widest = max(spec.out_features for spec in projection_specs(arch))
    config = LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    assert config.expand_gemm_tokens == 65
    layouts = []
    for min_width in (widest + 1, widest):
        monkeypatch.setattr(lora_runner, "GEMM_EXPAND_MIN_WIDTH", min_width)
        model = load_model(str(model_dir), arch, torch.float32, "cpu", reference_paged_attention, load_format="dummy",
                           progress=False)  # fmt: skip
        runner = lora_runner.RunnerLoRA(config, model, 16, torch.float32, torch.device("cpu"), use_kernels=True)
        b = runner.store.weights.b["gate_up_proj"]
        layouts.append(b.is_contiguous())  # slot-major: contiguous; output-major: a permuted view
    assert layouts == [True, False]


def test_the_overlap_stays_below_the_gemm_expand():
    """Steps the adapter would run overlapped (into a float32 buffer) never reach the cuBLAS
    expand, which adds in y's own dtype: the overlap's bound is held under the GEMM's."""
    from llmserve.lora.ops import triton_lora_ops

    assert triton_lora_ops(65, overlap_max_tokens=1).overlap_max_tokens == 1
    assert triton_lora_ops(65, overlap_max_tokens=100).overlap_max_tokens == 64
    assert triton_lora_ops(0, overlap_max_tokens=100).overlap_max_tokens == 100
