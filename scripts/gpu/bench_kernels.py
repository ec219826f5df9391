#!/usr/bin/env python3
"""Check and time llmserve's Triton kernels on a GPU (run on the H200 device machine).

1. Correctness: every kernel against its PyTorch reference at Llama-3.1-8B-like shapes
   (32 query heads, 8 KV heads, head dim 128, bf16, block 16), plus other GQA ratios, head
   dims and dtypes; prints the max abs error of each.
2. Decode attention at batch 1/32/256 x context 512/1024/4096/8192: Triton with split-KV
   as chosen by the heuristic ("auto") and forced off, against torch SDPA on contiguous KV
   (`enable_gqa=True`, FLASH and CUDNN backends) as the bar; achieved KV-read TB/s.
   Plus a sweep of forced split counts and of decode tile configs (to tune the defaults).
3. Prefill: 16 x 1024-token causal prefill against SDPA (TFLOP/s, causal FLOPs counted
   as 4 * Hq * D * visible (query, key) pairs); a mixed batch of chunked prefills after
   cached prefixes plus decodes; a sweep of prefill tile configs.
4. The fused RMSNorm (with and without residual), rotary, SiLU-and-mul and KV write
   against their torch references (time and effective GB/s).

Timing: CUDA events around one call, median of N, a 256 MB L2 flush before each call,
and the call replayed from a CUDA graph where capture works (as decode runs in serving).
Writes $OUT/kernels.json and $OUT/kernels.txt. Needs only torch, triton and numpy;
each variant is wrapped so that one failure is recorded and the rest still run.

    python3 scripts/gpu/bench_kernels.py [--budget-s 170] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
# Import llmserve's kernels and model layers without running llmserve/__init__.py, which
# pulls in the engine and server (zmq, msgspec, fastapi... not on the GPU image).
if "llmserve" not in sys.modules:
    _pkg = types.ModuleType("llmserve")
    _pkg.__path__ = [str(REPO / "llmserve")]
    sys.modules["llmserve"] = _pkg

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
HQ, HKV, HEAD_DIM, BLOCK = 32, 8, 128, 16
DT = torch.bfloat16
TOL = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 3e-2}

RESULTS: dict = {
    "checks": [], "decode": [], "decode_split_sweep": [], "decode_config_sweep": [],
    "prefill": [], "prefill_config_sweep": [], "elementwise": [], "errors": [],
}  # fmt: skip
T0 = time.time()
BUDGET_S = 170.0
DECODE_CONFIGS: list[tuple[int, ...]] = []  # --decode-configs: (block_n, num_warps, num_stages)
PREFILL_CONFIGS: list[tuple[int, ...]] = []  # --prefill-configs: (block_m, block_n, warps, stages)
SPLIT_POINTS: list[tuple[int, int]] = []  # --split-points: (batch, ctx)
CONFIG_POINTS: list[tuple[int, ...]] = []  # --config-points


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def over_budget() -> bool:
    return time.time() - T0 > BUDGET_S


def record_error(section: str, name: str, exc: BaseException) -> dict:
    err = {"section": section, "name": name, "error": f"{type(exc).__name__}: {exc}"}
    err["trace"] = traceback.format_exc(limit=6)
    RESULTS["errors"].append(err)
    log(f"ERROR {section}/{name}: {err['error']}")
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - a broken context: later variants will say so
        pass
    return err


# -- timing ------------------------------------------------------------------------------

_FLUSH: torch.Tensor | None = None


def _graph_replay(fn):
    """fn captured into a CUDA graph (returns replay), or None when capture fails."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        graph._keep = fn  # noqa: SLF001 - keep the captured closure's tensors alive
        return graph.replay
    except Exception:  # noqa: BLE001 - fall back to eager timing
        torch.cuda.synchronize()
        return None


def bench_ms(fn, iters: int = 20, warmup: int = 3, graph: bool = True) -> tuple[float, str]:
    """Median milliseconds of one call (L2 flushed before each), and 'graph' or 'eager'."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(64 * 1024 * 1024, dtype=torch.float32, device="cuda")
    run = _graph_replay(fn) if graph else None
    mode = "graph" if run is not None else "eager"
    run = run or fn
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        _FLUSH.zero_()
        starts[i].record()
        run()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)), mode


# -- batches -----------------------------------------------------------------------------


def make_batch(query_lens, seq_lens, *, hq=HQ, hkv=HKV, d=HEAD_DIM, bs=BLOCK, dtype=DT,
               seed=0, extra_blocks=1, randn_cache=True):  # fmt: skip
    """q, k, v, kv_cache, meta for a flat varlen batch with shuffled (scattered) blocks."""
    from llmserve.model.attention import AttentionMetadata

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(seed)
    num_tokens = sum(query_lens)
    nblk = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(nblk) + extra_blocks
    cache = torch.empty(2, num_blocks, bs, hkv, d, dtype=dtype, device=dev)
    if randn_cache:
        cache.normal_(generator=g)
    else:
        cache.uniform_(-1, 1, generator=g)
    perm = torch.randperm(num_blocks - 1, device=dev, generator=g).to(torch.int32) + 1
    max_blocks = max(nblk) + 1
    bt = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32, device=dev)
    slots, used = [], 0
    bt_host = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int64)
    perm_host = perm.cpu()
    for i, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
        bt_host[i, : nblk[i]] = perm_host[used : used + nblk[i]]
        used += nblk[i]
        pos = torch.arange(sl - ql, sl)
        slots.append(bt_host[i, pos // bs] * bs + pos % bs)
    bt.copy_(bt_host.to(torch.int32))
    qsl = [0]
    for ql in query_lens:
        qsl.append(qsl[-1] + ql)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=bt,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    q = torch.randn(num_tokens, hq, d, dtype=dtype, device=dev, generator=g)
    k = torch.randn(num_tokens, hkv, d, dtype=dtype, device=dev, generator=g)
    v = torch.randn(num_tokens, hkv, d, dtype=dtype, device=dev, generator=g)
    return q, k, v, cache, meta


def visible_pairs(query_lens, seq_lens) -> int:
    total = 0
    for ql, sl in zip(query_lens, seq_lens):
        c = sl - ql
        total += ql * c + ql * (ql + 1) // 2
    return total


# -- 1. correctness ------------------------------------------------------------------------


def checks(quick: bool) -> None:
    from llmserve.kernels import (
        apply_rotary,
        fused_add_rms_norm,
        rms_norm,
        silu_and_mul,
        triton_paged_attention,
        write_kv,
    )  # fmt: skip
    from llmserve.model.arch import RopeConfig
    from llmserve.model.attention import reference_paged_attention, write_kv_cache
    from llmserve.model.layers import RMSNorm, RotaryEmbedding
    from llmserve.model.layers import silu_and_mul as ref_silu

    def add(name, err, tol, **extra):
        ok = bool(err <= tol) and math.isfinite(err)
        RESULTS["checks"].append({"name": name, "max_abs_err": err, "tol": tol, "ok": ok, **extra})
        log(f"check {name}: max abs err {err:.3g} (tol {tol:g}) {'ok' if ok else 'FAIL'}")

    def add_rel(name, pairs, tol):
        """Elementwise kernels: error measured against max(1, |ref|) (one ulp of a large
        value is large), recorded as abs error with the scaled tolerance."""
        err = max((o.float() - e.float()).abs().max().item() for o, e in pairs)
        scale = max(1.0, *(e.float().abs().max().item() for _, e in pairs))
        add(name, err, tol * scale, ref_absmax=scale)

    # mixed batch: decodes of many lengths, a fresh prefill, chunks after cached prefixes
    mixed_q = [1, 1, 1, 1, 1, 300, 257, 1, 64, 1]
    mixed_s = [37, 512, 1000, 4097, 8192, 300, 1257, 16, 64 + 2048, 2]
    shapes = [(HQ, HKV, HEAD_DIM), (32, 32, 128), (64, 8, 128), (16, 2, 64), (28, 4, 96)]
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    cases = [(shapes[0], dt) for dt in dtypes] + [(s, DT) for s in shapes[1:]]
    if quick:
        cases = cases[:2]
    for (hq, hkv, d), dt in cases:
        for splits in (None, 1, 7):
            name = f"attn mixed hq{hq} hkv{hkv} d{d} {str(dt)[6:]} splits={splits}"
            try:
                q, k, v, cache, meta = make_batch(mixed_q, mixed_s, hq=hq, hkv=hkv, d=d, dtype=dt)
                ref_cache = cache.clone()
                ref = reference_paged_attention(q, k, v, ref_cache, meta, d**-0.5)
                out = triton_paged_attention(q, k, v, cache, meta, d**-0.5, num_splits=splits)
                torch.cuda.synchronize()
                cache_err = (cache.float() - ref_cache.float()).abs().max().item()
                err = (out.float() - ref.float()).abs().max().item()
                add(name, max(err, cache_err), TOL[dt], cache_err=cache_err)
                del q, k, v, cache, ref_cache, ref, out
            except Exception as exc:  # noqa: BLE001
                record_error("checks", name, exc)
    torch.cuda.empty_cache()

    # fresh long prompts beside decodes and a cached chunk (meta.fresh_seqs): SDPA for the
    # prompts of SDPA_PREFILL_TOKENS or more, the kernel in runs for the rest
    from llmserve.kernels.paged_attention import SDPA_PREFILL_TOKENS

    fresh_q, fresh_s = [1, 1, 3000, 257, 2500, 700, 1], [512, 4097, 3000, 1257, 2500, 700, 16]
    for dt in (torch.bfloat16, torch.float16):
        name = f"attn fresh prompts by sdpa {str(dt)[6:]}"
        try:
            q, k, v, cache, meta = make_batch(fresh_q, fresh_s, dtype=dt)
            starts = [sum(fresh_q[:i]) for i in range(len(fresh_q))]
            meta.num_decode_seqs = 2
            meta.fresh_seqs = tuple(
                (i, starts[i], n) for i, (n, s) in enumerate(zip(fresh_q, fresh_s)) if n == s and n > 1
            )
            ref_cache = cache.clone()
            ref = reference_paged_attention(q, k, v, ref_cache, meta, HEAD_DIM**-0.5)
            out = triton_paged_attention(q, k, v, cache, meta, HEAD_DIM**-0.5)
            torch.cuda.synchronize()
            err = (out.float() - ref.float()).abs().max().item()
            add(name, err, TOL[dt], sdpa_seqs=sum(n >= SDPA_PREFILL_TOKENS for _, _, n in meta.fresh_seqs))
            del q, k, v, cache, ref_cache, ref, out
        except Exception as exc:  # noqa: BLE001
            record_error("checks", name, exc)
    torch.cuda.empty_cache()

    # later chunks after a cached prefix (meta.chunk_seqs): SDPA over the whole sequence where
    # the front padding pays (seq 2: 3,000 after 500), the kernel where it does not (seq 3: 2,100
    # after 6,000), beside decodes and a fresh prompt
    chunk_q, chunk_s = [1, 1, 3000, 2100, 2500, 300], [512, 4097, 3500, 8100, 2500, 800]
    for dt in (torch.bfloat16, torch.float16):
        name = f"attn later chunks by sdpa {str(dt)[6:]}"
        try:
            q, k, v, cache, meta = make_batch(chunk_q, chunk_s, dtype=dt, seed=4)
            starts = [sum(chunk_q[:i]) for i in range(len(chunk_q))]
            meta.num_decode_seqs = 2
            meta.fresh_seqs = ((4, starts[4], 2500),)
            meta.chunk_seqs = tuple((i, starts[i], n, s - n) for i, (n, s) in enumerate(zip(chunk_q, chunk_s))
                                    if 1 < n < s)  # fmt: skip
            ref_cache = cache.clone()
            ref = reference_paged_attention(q, k, v, ref_cache, meta, HEAD_DIM**-0.5)
            out = triton_paged_attention(q, k, v, cache, meta, HEAD_DIM**-0.5)
            torch.cuda.synchronize()
            err = (out.float() - ref.float()).abs().max().item()
            from llmserve.kernels.paged_attention import pad_front_pays

            add(name, err, TOL[dt], sdpa_chunks=sum(pad_front_pays(c, n) for _, _, n, c in meta.chunk_seqs))
            del q, k, v, cache, ref_cache, ref, out
        except Exception as exc:  # noqa: BLE001
            record_error("checks", name, exc)
    torch.cuda.empty_cache()

    # decode-only batch with random lengths (the one-tile-per-sequence launch)
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(1, 4097, (64,), generator=gen).tolist()
    for splits in (None, 1, 16):
        name = f"attn decode b64 random ctx splits={splits}"
        try:
            q, k, v, cache, meta = make_batch([1] * 64, lens)
            ref_cache = cache.clone()
            ref = reference_paged_attention(q, k, v, ref_cache, meta, HEAD_DIM**-0.5)
            out = triton_paged_attention(q, k, v, cache, meta, HEAD_DIM**-0.5, num_splits=splits)
            err = (out.float() - ref.float()).abs().max().item()
            add(name, err, TOL[DT])
        except Exception as exc:  # noqa: BLE001
            record_error("checks", name, exc)

    # KV write, with skipped slots
    try:
        q, k, v, cache, meta = make_batch([1000, 1, 1], [1500, 20, 30])
        meta.slot_mapping[5:50] = -1
        ref_cache = cache.clone()
        write_kv_cache(k, v, ref_cache, meta.slot_mapping)
        write_kv(k, v, cache, meta.slot_mapping)
        add("write_kv (slots -1 skipped)", (cache.float() - ref_cache.float()).abs().max().item(), 0.0)
    except Exception as exc:  # noqa: BLE001
        record_error("checks", "write_kv", exc)

    tokens, hidden = 4096, 4096
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        tag = str(dt)[6:]
        try:
            normm = RMSNorm(hidden, 1e-5).to("cuda", dt)
            with torch.no_grad():
                normm.weight.normal_()
            x = torch.randn(tokens, hidden, device="cuda", dtype=dt)
            r = torch.randn(tokens, hidden, device="cuda", dtype=dt)
            with torch.no_grad():
                e1 = normm(x)
                e2, er = normm(x, r)
            o1 = rms_norm(x, normm.weight.detach(), 1e-5)
            o2, orr = fused_add_rms_norm(x, r, normm.weight.detach(), 1e-5)
            add_rel(f"rms_norm {tag}", [(o1, e1)], TOL[dt] / 3)
            add_rel(f"fused_add_rms_norm {tag}", [(o2, e2), (orr, er)], TOL[dt] / 3)
        except Exception as exc:  # noqa: BLE001
            record_error("checks", f"norm {tag}", exc)
        try:
            rope = RotaryEmbedding(HEAD_DIM, 8192, RopeConfig(theta=500000.0, rope_type="llama3",
                                   factor=8.0, original_max_position_embeddings=8192)).to("cuda")  # fmt: skip
            qkv = torch.randn(tokens, (HQ + 2 * HKV) * HEAD_DIM, device="cuda", dtype=dt)
            qv, kv_, _ = qkv.split([HQ * HEAD_DIM, HKV * HEAD_DIM, HKV * HEAD_DIM], dim=-1)
            qv = qv.view(tokens, HQ, HEAD_DIM)
            kv_ = kv_.view(tokens, HKV, HEAD_DIM)
            pos = torch.randint(0, 8192, (tokens,), device="cuda")
            eq, ek = rope(pos, qv, kv_)
            oq, ok = apply_rotary(qv, kv_, pos, rope.cos_sin)
            add_rel(f"rotary {tag}", [(oq, eq), (ok, ek)], TOL[dt] / 3)
        except Exception as exc:  # noqa: BLE001
            record_error("checks", f"rotary {tag}", exc)
        try:
            gu = torch.randn(tokens, 2 * 14336, device="cuda", dtype=dt) * 3
            add_rel(f"silu_and_mul {tag}", [(silu_and_mul(gu), ref_silu(gu))], TOL[dt] / 3)
        except Exception as exc:  # noqa: BLE001
            record_error("checks", f"silu {tag}", exc)
    torch.cuda.empty_cache()


# -- 2. decode ----------------------------------------------------------------------------


def _sdpa_backends():
    from torch.nn.attention import SDPBackend

    return [("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)]


def _sdpa_call(backend, q, k, v, causal):
    from torch.nn.attention import sdpa_kernel

    def call():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    return call


def decode(quick: bool) -> None:
    from llmserve.kernels import choose_num_splits, paged_attention_forward

    batches = [1, 32, 256]
    contexts = [512, 1024, 4096, 8192]
    if quick:
        batches, contexts = [1, 32], [1024, 4096]
    elt = torch.empty((), dtype=DT).element_size()
    for b in batches:
        for ctx in contexts:
            if over_budget():
                RESULTS["errors"].append(
                    {"section": "decode", "name": f"b{b} ctx{ctx}", "error": "skipped: time budget"}
                )
                continue
            kv_bytes = b * ctx * HKV * HEAD_DIM * 2 * elt
            try:
                q, k, v, cache, meta = make_batch([1] * b, [ctx] * b, randn_cache=False)
            except Exception as exc:  # noqa: BLE001
                record_error("decode", f"b{b} ctx{ctx} setup", exc)
                continue
            auto = choose_num_splits(b, HKV, ctx, torch.cuda.get_device_properties(0).multi_processor_count)
            variants = [("triton_auto", auto)]
            if auto != 1:
                variants.append(("triton_nosplit", 1))
            for name, splits in variants:
                try:
                    ms, mode = bench_ms(
                        lambda s=splits: paged_attention_forward(q, cache, meta, HEAD_DIM**-0.5, num_splits=s)
                    )
                    row = dict(batch=b, ctx=ctx, impl=name, splits=splits, ms=ms, mode=mode,
                               tbps=kv_bytes / (ms * 1e-3) / 1e12)  # fmt: skip
                    RESULTS["decode"].append(row)
                    log(f"decode b{b} ctx{ctx} {name}(splits={splits}): {ms:.4f} ms {row['tbps']:.2f} TB/s [{mode}]")
                except Exception as exc:  # noqa: BLE001
                    record_error("decode", f"b{b} ctx{ctx} {name}", exc)
            del q, k, v, cache, meta
            torch.cuda.empty_cache()
            try:
                qs = torch.randn(b, HQ, 1, HEAD_DIM, device="cuda", dtype=DT)
                ks = torch.empty(b, HKV, ctx, HEAD_DIM, device="cuda", dtype=DT).uniform_(-1, 1)
                vs = torch.empty_like(ks).uniform_(-1, 1)
                for name, backend in _sdpa_backends():
                    try:
                        ms, mode = bench_ms(_sdpa_call(backend, qs, ks, vs, False))
                        row = dict(batch=b, ctx=ctx, impl=name, splits=None, ms=ms, mode=mode,
                                   tbps=kv_bytes / (ms * 1e-3) / 1e12)  # fmt: skip
                        RESULTS["decode"].append(row)
                        log(f"decode b{b} ctx{ctx} {name}: {ms:.4f} ms {row['tbps']:.2f} TB/s [{mode}]")
                    except Exception as exc:  # noqa: BLE001
                        record_error("decode", f"b{b} ctx{ctx} {name}", exc)
                del qs, ks, vs
            except Exception as exc:  # noqa: BLE001
                record_error("decode", f"b{b} ctx{ctx} sdpa setup", exc)
            torch.cuda.empty_cache()


def decode_sweeps(quick: bool) -> None:
    from llmserve.kernels import AttnLaunchConfig, paged_attention_forward

    elt = torch.empty((), dtype=DT).element_size()
    points = SPLIT_POINTS or [(1, 4096), (1, 8192), (8, 4096), (16, 2048), (32, 1024), (32, 4096),
                              (64, 2048)]  # fmt: skip
    split_values = [1, 2, 4, 8, 16, 32]
    if quick:
        points, split_values = [(1, 8192), (32, 4096)], [1, 4, 16]
    for b, ctx in points:
        if over_budget():
            break
        try:
            q, k, v, cache, meta = make_batch([1] * b, [ctx] * b, randn_cache=False)
        except Exception as exc:  # noqa: BLE001
            record_error("decode_split_sweep", f"b{b} ctx{ctx} setup", exc)
            continue
        kv_bytes = b * ctx * HKV * HEAD_DIM * 2 * elt
        for s in split_values:
            try:
                ms, mode = bench_ms(
                    lambda s=s: paged_attention_forward(q, cache, meta, HEAD_DIM**-0.5, num_splits=s), iters=15
                )
                RESULTS["decode_split_sweep"].append(
                    dict(batch=b, ctx=ctx, splits=s, ms=ms, mode=mode, tbps=kv_bytes / (ms * 1e-3) / 1e12)
                )
                log(f"split sweep b{b} ctx{ctx} splits={s}: {ms:.4f} ms {kv_bytes / (ms * 1e-3) / 1e12:.2f} TB/s")
            except Exception as exc:  # noqa: BLE001
                record_error("decode_split_sweep", f"b{b} ctx{ctx} s{s}", exc)
        del q, k, v, cache, meta
        torch.cuda.empty_cache()

    configs = DECODE_CONFIGS or [(64, 4, 3), (32, 4, 3), (64, 4, 2), (64, 2, 3), (128, 4, 2),
                                 (128, 4, 3), (128, 2, 3), (128, 8, 3), (256, 4, 2)]  # fmt: skip
    points = [(b, ctx, None) for b, ctx in CONFIG_POINTS] or [(32, 4096, None), (256, 1024, None), (256, 4096, None),
                                                              (1, 8192, None)]  # fmt: skip
    if quick:
        configs, points = configs[:3], points[:1]
    for b, ctx, splits in points:
        if over_budget():
            break
        try:
            q, k, v, cache, meta = make_batch([1] * b, [ctx] * b, randn_cache=False)
            base = paged_attention_forward(q, cache, meta, HEAD_DIM**-0.5, num_splits=splits)
        except Exception as exc:  # noqa: BLE001
            record_error("decode_config_sweep", f"b{b} ctx{ctx} setup", exc)
            continue
        kv_bytes = b * ctx * HKV * HEAD_DIM * 2 * elt
        for bn, nw, ns in configs:
            if over_budget():
                break
            cfg = AttnLaunchConfig(block_m=16, block_n=bn, num_warps=nw, num_stages=ns)
            try:
                out = paged_attention_forward(q, cache, meta, HEAD_DIM**-0.5, num_splits=splits, config=cfg)
                diff = (out.float() - base.float()).abs().max().item()
                ms, mode = bench_ms(
                    lambda c=cfg: paged_attention_forward(q, cache, meta, HEAD_DIM**-0.5, num_splits=splits, config=c),
                    iters=15,
                )
                row = dict(batch=b, ctx=ctx, block_n=bn, num_warps=nw, num_stages=ns, ms=ms, mode=mode,
                           tbps=kv_bytes / (ms * 1e-3) / 1e12, max_diff_vs_default=diff)  # fmt: skip
                RESULTS["decode_config_sweep"].append(row)
                log(f"decode cfg b{b} ctx{ctx} bn{bn} w{nw} s{ns}: {ms:.4f} ms {row['tbps']:.2f} TB/s diff {diff:.2g}")
            except Exception as exc:  # noqa: BLE001
                record_error("decode_config_sweep", f"b{b} ctx{ctx} bn{bn} w{nw} s{ns}", exc)
        del q, k, v, cache, meta, base
        torch.cuda.empty_cache()


# -- 3. prefill ---------------------------------------------------------------------------


def sweep_tiles(section: str, case: str, configs, q, cache, meta, base, flops: float, iters: int = 10) -> None:
    """Each tile config on one batch: time, TFLOP/s, and its largest difference from `base`."""
    from llmserve.kernels import AttnLaunchConfig, paged_attention_forward

    for bm, bn, nw, ns in configs:
        if over_budget():
            break
        cfg = AttnLaunchConfig(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
        try:
            out = paged_attention_forward(q, cache, meta, HEAD_DIM**-0.5, config=cfg)
            diff = (out.float() - base.float()).abs().max().item()
            ms, mode = bench_ms(
                lambda c=cfg: paged_attention_forward(q, cache, meta, HEAD_DIM**-0.5, config=c), iters=iters
            )
            row = dict(case=case, block_m=bm, block_n=bn, num_warps=nw, num_stages=ns, impl=f"triton bm{bm} bn{bn} w{nw} s{ns}",
                       ms=ms, mode=mode, tflops=flops / (ms * 1e-3) / 1e12, max_diff_vs_default=diff)  # fmt: skip
            RESULTS[section].append(row)
            log(f"{case} bm{bm} bn{bn} w{nw} s{ns}: {ms:.4f} ms {row['tflops']:.1f} TFLOP/s diff {diff:.2g}")
        except Exception as exc:  # noqa: BLE001
            record_error(section, f"{case} bm{bm} bn{bn} w{nw} s{ns}", exc)


def prefill(quick: bool) -> None:
    from llmserve.kernels import paged_attention_forward

    n_seq, length = 16, 1024
    qlens, slens = [length] * n_seq, [length] * n_seq
    flops = 4 * HQ * HEAD_DIM * visible_pairs(qlens, slens)
    try:
        q, k, v, cache, meta = make_batch(qlens, slens, randn_cache=False)
        from llmserve.kernels import write_kv

        write_kv(k, v, cache, meta.slot_mapping)
        base = paged_attention_forward(q, cache, meta, HEAD_DIM**-0.5)
        ms, mode = bench_ms(lambda: paged_attention_forward(q, cache, meta, HEAD_DIM**-0.5))
        RESULTS["prefill"].append(
            dict(case="16x1024 causal", impl="triton", ms=ms, mode=mode, tflops=flops / (ms * 1e-3) / 1e12)
        )
        log(f"prefill 16x1024 triton: {ms:.4f} ms {flops / (ms * 1e-3) / 1e12:.1f} TFLOP/s")
    except Exception as exc:  # noqa: BLE001
        record_error("prefill", "triton 16x1024", exc)
        base = None
    try:
        qs = torch.randn(n_seq, HQ, length, HEAD_DIM, device="cuda", dtype=DT)
        ks = torch.randn(n_seq, HKV, length, HEAD_DIM, device="cuda", dtype=DT)
        vs = torch.randn(n_seq, HKV, length, HEAD_DIM, device="cuda", dtype=DT)
        for name, backend in _sdpa_backends():
            try:
                ms, mode = bench_ms(_sdpa_call(backend, qs, ks, vs, True))
                RESULTS["prefill"].append(
                    dict(case="16x1024 causal", impl=name, ms=ms, mode=mode, tflops=flops / (ms * 1e-3) / 1e12)
                )
                log(f"prefill 16x1024 {name}: {ms:.4f} ms {flops / (ms * 1e-3) / 1e12:.1f} TFLOP/s")
            except Exception as exc:  # noqa: BLE001
                record_error("prefill", name, exc)
        del qs, ks, vs
    except Exception as exc:  # noqa: BLE001
        record_error("prefill", "sdpa setup", exc)

    # prefill tile sweep on the same batch
    configs = PREFILL_CONFIGS or [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 32, 4, 3),
                                  (64, 64, 4, 3), (128, 32, 4, 4), (64, 32, 4, 3), (128, 32, 8, 3)]  # fmt: skip
    if quick:
        configs = configs[:2]
    if base is not None:
        sweep_tiles("prefill_config_sweep", "16x1024", configs, q, cache, meta, base, flops)
        del q, k, v, cache, meta, base
    torch.cuda.empty_cache()

    # mixed: 16 chunks of 1024 after 1024 cached tokens + 64 decodes at 2048
    if over_budget():
        return
    qlens = [1024] * 16 + [1] * 64
    slens = [2048] * 16 + [2048] * 64
    flops = 4 * HQ * HEAD_DIM * visible_pairs(qlens, slens)
    try:
        q, k, v, cache, meta = make_batch(qlens, slens, randn_cache=False)
        from llmserve.kernels import write_kv

        write_kv(k, v, cache, meta.slot_mapping)
        ms, mode = bench_ms(lambda: paged_attention_forward(q, cache, meta, HEAD_DIM**-0.5))
        RESULTS["prefill"].append(dict(case="16x1024 chunks after 1024 cached + 64 decodes @2048", impl="triton",
                                       ms=ms, mode=mode, tflops=flops / (ms * 1e-3) / 1e12))  # fmt: skip
        log(f"mixed chunked prefill triton: {ms:.4f} ms {flops / (ms * 1e-3) / 1e12:.1f} TFLOP/s")
        del q, k, v, cache, meta
    except Exception as exc:  # noqa: BLE001
        record_error("prefill", "mixed", exc)
    torch.cuda.empty_cache()


# -- 3b. long prefill ------------------------------------------------------------------------
LONG_CASES = [("1x7680 causal", [7680], [7680]), ("1x16384 causal", [16384], [16384]),
              ("16384 after 16384 cached (32k chunk 2)", [16384], [32768])]  # fmt: skip
LONG_CONFIGS = [(128, 32, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3),
                (128, 64, 8, 2), (256, 64, 8, 3)]  # fmt: skip


def long_prefill(quick: bool) -> None:
    """One long prompt's attention (what batch-1 TTFT at 8k-32k waits on): the default tiles,
    a tile sweep, and SDPA on contiguous KV (causal cases) as the bar."""
    from llmserve.kernels import paged_attention_forward, write_kv

    RESULTS.setdefault("long_prefill", [])
    for case, qlens, slens in LONG_CASES[: 1 if quick else None]:
        if over_budget():
            return
        flops = 4 * HQ * HEAD_DIM * visible_pairs(qlens, slens)
        try:
            q, k, v, cache, meta = make_batch(qlens, slens, randn_cache=False)
            write_kv(k, v, cache, meta.slot_mapping)
            base = paged_attention_forward(q, cache, meta, HEAD_DIM**-0.5)
            from llmserve.kernels.paged_attention import fresh_single_prefill, sdpa_prefill
            from llmserve.model.attention import reference_paged_attention

            small = qlens[0] * slens[0] <= 8192 * 8192  # the reference materialises [Hq, L, S] scores
            ref = reference_paged_attention(q, k, v, cache.clone(), meta, HEAD_DIM**-0.5) if small else base
            err = (base.float() - ref.float()).abs().max().item() if small else float("nan")
            if small:
                RESULTS["checks"].append(dict(name=f"long {case} triton default", max_abs_err=err, tol=TOL[DT],
                                              ok=err <= TOL[DT]))  # fmt: skip
            ms, mode = bench_ms(lambda: paged_attention_forward(q, cache, meta, HEAD_DIM**-0.5), iters=10)
            RESULTS["long_prefill"].append(dict(case=case, impl="triton default", ms=ms, tflops=flops / ms / 1e9,
                                                max_diff_vs_reference=err))  # fmt: skip
            log(f"long {case} triton default: {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s, vs reference {err:.2g}")
            if small and fresh_single_prefill(meta):  # what the engine runs for this case: SDPA on the new q/k/v
                fast = sdpa_prefill(q, k, v, HEAD_DIM**-0.5)
                err = float("nan") if fast is None else (fast.float() - ref.float()).abs().max().item()
                RESULTS["checks"].append(dict(name=f"long {case} sdpa_prefill", max_abs_err=err, tol=TOL[DT],
                                              ok=err <= TOL[DT]))  # fmt: skip
                ms, mode = bench_ms(lambda: sdpa_prefill(q, k, v, HEAD_DIM**-0.5), iters=10)
                RESULTS["long_prefill"].append(dict(case=case, impl="engine: sdpa_prefill", ms=ms,
                                                    tflops=flops / ms / 1e9, max_diff_vs_reference=err))  # fmt: skip
                log(f"long {case} sdpa_prefill: {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s, vs reference {err:.2g}")
            del ref
            sweep_tiles("long_prefill", case, LONG_CONFIGS, q, cache, meta, base, flops)
            del q, k, v, cache, meta, base
            if qlens == slens:  # the bar: SDPA, contiguous KV, causal
                qs = torch.randn(1, HQ, qlens[0], HEAD_DIM, device="cuda", dtype=DT)
                ks = torch.randn(1, HKV, qlens[0], HEAD_DIM, device="cuda", dtype=DT)
                vs = torch.randn(1, HKV, qlens[0], HEAD_DIM, device="cuda", dtype=DT)
                for name, backend in _sdpa_backends():
                    try:
                        ms, mode = bench_ms(_sdpa_call(backend, qs, ks, vs, True), iters=10)
                        RESULTS["long_prefill"].append(dict(case=case, impl=name, ms=ms, tflops=flops / ms / 1e9))
                        log(f"long {case} {name}: {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s")
                    except Exception as exc:  # noqa: BLE001
                        record_error("long_prefill", f"{case} {name}", exc)
                del qs, ks, vs
        except Exception as exc:  # noqa: BLE001
            record_error("long_prefill", case, exc)
        torch.cuda.empty_cache()


def kernel_against_sdpa(section: str, label: str, fields: dict, batch: tuple, flops: float,
                        use: Callable[[str], None], iters: int) -> None:  # fmt: skip
    """`triton_paged_attention` on `batch` (q, k, v, cache, meta) with `use("kernel")`, then
    `use("sdpa")`, switching its path: each timed eager, as the engine runs a prefill's attention
    (between the piecewise graphs), recorded in RESULTS[section] with `fields`, and the two
    outputs checked against each other."""
    from llmserve.kernels import paged_attention as pa

    q, k, v, cache, meta = batch
    outs = {}
    for impl in ("kernel", "sdpa"):
        use(impl)
        outs[impl] = pa.triton_paged_attention(q, k, v, cache, meta, HEAD_DIM**-0.5)
        ms, mode = bench_ms(lambda: pa.triton_paged_attention(q, k, v, cache, meta, HEAD_DIM**-0.5), iters=iters,
                            graph=False)  # fmt: skip
        RESULTS[section].append(dict(**fields, impl=impl, ms=ms, mode=mode, tflops=flops / ms / 1e9))
        log(f"{label} {impl}: {ms:.4f} ms {flops / ms / 1e9:.1f} TFLOP/s ({mode})")
    diff = (outs["kernel"].float() - outs["sdpa"].float()).abs().max().item()
    RESULTS["checks"].append(dict(name=f"{label} sdpa vs kernel", max_abs_err=diff, tol=TOL[DT], ok=diff <= TOL[DT]))


def fresh_prompts(quick: bool) -> None:
    """Where SDPA should take over from the kernel for fresh prompts in a step (what
    SDPA_PREFILL_TOKENS decides): B prompts of L tokens, no cached prefix, through
    `triton_paged_attention` (the KV write included) with meta.fresh_seqs listed and the
    threshold at 1 (SDPA, one call a prompt) or past L (the kernel), per length and count."""
    from llmserve.kernels import paged_attention as pa

    RESULTS.setdefault("fresh_prompts", [])
    saved = pa.SDPA_PREFILL_TOKENS
    for length, count in [(512, 1), (512, 32), (1024, 1), (1024, 16), (1536, 10), (2048, 1), (2048, 8)]:
        if over_budget():
            break
        try:
            q, k, v, cache, meta = make_batch([length] * count, [length] * count, randn_cache=False)
            meta.fresh_seqs = tuple((i, i * length, length) for i in range(count))
            flops = 4 * HQ * HEAD_DIM * visible_pairs([length] * count, [length] * count)

            def use(impl: str) -> None:
                pa.SDPA_PREFILL_TOKENS = length + 1 if impl == "kernel" else 1

            kernel_against_sdpa("fresh_prompts", f"fresh {count}x{length}", dict(length=length, count=count),
                                (q, k, v, cache, meta), flops, use, iters=10)  # fmt: skip
            del q, k, v, cache, meta
        except Exception as exc:  # noqa: BLE001
            record_error("fresh_prompts", f"{count}x{length}", exc)
        finally:
            pa.SDPA_PREFILL_TOKENS = saved
        torch.cuda.empty_cache()


def later_chunks(quick: bool) -> None:
    """Where a prompt's later chunk (`count` new tokens after `cached`) should go to SDPA over its
    whole sequence, queries padded in front (what `pad_front_pays` and SDPA_SPEEDUP decide):
    `triton_paged_attention` with meta.chunk_seqs listed and SDPA_SPEEDUP forced to 0 (the
    kernel) or 1e9 (SDPA_CHUNK_MIN_TOKENS lowered to 0), eager; TFLOP/s count the chunk's own
    query-key pairs only."""
    from llmserve.kernels import paged_attention as pa

    RESULTS.setdefault("later_chunks", [])
    saved, saved_min = pa.SDPA_SPEEDUP, pa.SDPA_CHUNK_MIN_TOKENS
    cases = [(16384, 16384), (1024, 6656), (2048, 5632), (3072, 4608), (4096, 3584), (5120, 2560), (6144, 2048),
             (512, 7168), (8192, 8192), (4096, 12288), (12288, 4096), (2048, 2048), (1024, 4096), (2048, 4096),
             (3072, 3072), (1024, 5120), (512, 2048), (1536, 4608)]  # fmt: skip
    for cached, count in cases:
        if over_budget():
            break
        try:
            q, k, v, cache, meta = make_batch([count], [cached + count], randn_cache=False)
            meta.chunk_seqs = ((0, 0, count, cached),)
            flops = 4 * HQ * HEAD_DIM * visible_pairs([count], [cached + count])

            def use(impl: str) -> None:
                pa.SDPA_SPEEDUP, pa.SDPA_CHUNK_MIN_TOKENS = (0.0 if impl == "kernel" else 1e9), 0

            kernel_against_sdpa("later_chunks", f"chunk {count} after {cached}", dict(cached=cached, count=count),
                                (q, k, v, cache, meta), flops, use, iters=5)  # fmt: skip
            pa.SDPA_SPEEDUP, pa.SDPA_CHUNK_MIN_TOKENS = saved, saved_min
            RESULTS["later_chunks"][-1]["rule_pays"] = pa.pad_front_pays(cached, count)
            del q, k, v, cache, meta
        except Exception as exc:  # noqa: BLE001
            record_error("later_chunks", f"{count}@{cached}", exc)
        finally:
            pa.SDPA_SPEEDUP, pa.SDPA_CHUNK_MIN_TOKENS = saved, saved_min
        torch.cuda.empty_cache()


def sdpa_new_lengths(quick: bool) -> None:
    """What a prompt of a length not seen before costs on its first SDPA call (cuDNN builds
    an execution plan per shape): first and second call at five fresh lengths near 4k."""
    from llmserve.kernels.paged_attention import sdpa_prefill

    RESULTS.setdefault("sdpa_new_lengths", [])
    for n in (4001, 4003, 4007, 4011, 4013):
        q = torch.randn(n, HQ, HEAD_DIM, device="cuda", dtype=DT)
        k = torch.randn(n, HKV, HEAD_DIM, device="cuda", dtype=DT)
        v = torch.randn(n, HKV, HEAD_DIM, device="cuda", dtype=DT)
        times = []
        for _ in range(2):
            torch.cuda.synchronize()
            start = time.perf_counter()
            sdpa_prefill(q, k, v, HEAD_DIM**-0.5)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1000)
        RESULTS["sdpa_new_lengths"].append(dict(tokens=n, first_ms=times[0], second_ms=times[1]))
        log(f"sdpa_prefill {n} tokens: first call {times[0]:.2f} ms, second {times[1]:.2f} ms")


# -- 4. elementwise -------------------------------------------------------------------------


def elementwise() -> None:
    from llmserve.kernels import apply_rotary, fused_add_rms_norm, rms_norm, silu_and_mul, write_kv
    from llmserve.model.arch import RopeConfig
    from llmserve.model.attention import write_kv_cache
    from llmserve.model.layers import RMSNorm, RotaryEmbedding
    from llmserve.model.layers import silu_and_mul as ref_silu

    tokens, hidden, inter = 8192, 4096, 14336
    elt = 2

    def add(name, impl, fn, nbytes):
        try:
            ms, mode = bench_ms(fn, iters=20)
            RESULTS["elementwise"].append(
                dict(kernel=name, impl=impl, ms=ms, mode=mode, gbps=nbytes / (ms * 1e-3) / 1e9)
            )
            log(f"{name} {impl}: {ms:.4f} ms {nbytes / (ms * 1e-3) / 1e9:.0f} GB/s")
        except Exception as exc:  # noqa: BLE001
            record_error("elementwise", f"{name} {impl}", exc)

    try:
        normm = RMSNorm(hidden, 1e-5).to("cuda", DT)
        w = normm.weight.detach()
        x = torch.randn(tokens, hidden, device="cuda", dtype=DT)
        r = torch.randn(tokens, hidden, device="cuda", dtype=DT)
        nb = tokens * hidden * elt
        with torch.no_grad():
            add("rms_norm", "triton", lambda: rms_norm(x, w, 1e-5), 2 * nb)
            add("rms_norm", "torch", lambda: normm(x), 2 * nb)
            add("fused_add_rms_norm", "triton", lambda: fused_add_rms_norm(x, r, w, 1e-5), 4 * nb)
            add("fused_add_rms_norm", "torch", lambda: normm(x, r), 4 * nb)
    except Exception as exc:  # noqa: BLE001
        record_error("elementwise", "norm setup", exc)
    try:
        rope = RotaryEmbedding(HEAD_DIM, 8192, RopeConfig(theta=500000.0)).to("cuda")
        qkv = torch.randn(tokens, (HQ + 2 * HKV) * HEAD_DIM, device="cuda", dtype=DT)
        qv, kv_, _ = qkv.split([HQ * HEAD_DIM, HKV * HEAD_DIM, HKV * HEAD_DIM], dim=-1)
        qv = qv.view(tokens, HQ, HEAD_DIM)
        kv_ = kv_.view(tokens, HKV, HEAD_DIM)
        pos = torch.arange(tokens, device="cuda")
        nb = 2 * tokens * (HQ + HKV) * HEAD_DIM * elt
        add("rotary", "triton", lambda: apply_rotary(qv, kv_, pos, rope.cos_sin), nb)
        add("rotary", "triton_inplace", lambda: apply_rotary(qv, kv_, pos, rope.cos_sin, inplace=True), nb)
        add("rotary", "torch", lambda: rope(pos, qv, kv_), nb)
    except Exception as exc:  # noqa: BLE001
        record_error("elementwise", "rotary setup", exc)
    try:
        gu = torch.randn(tokens, 2 * inter, device="cuda", dtype=DT)
        nb = 3 * tokens * inter * elt
        add("silu_and_mul", "triton", lambda: silu_and_mul(gu), nb)
        add("silu_and_mul", "torch", lambda: ref_silu(gu), nb)
    except Exception as exc:  # noqa: BLE001
        record_error("elementwise", "silu setup", exc)
    try:
        q, k, v, cache, meta = make_batch([tokens], [tokens], randn_cache=False)
        nb = 2 * 2 * tokens * HKV * HEAD_DIM * elt
        add("write_kv", "triton", lambda: write_kv(k, v, cache, meta.slot_mapping), nb)
        add("write_kv", "torch", lambda: write_kv_cache(k, v, cache, meta.slot_mapping), nb)
    except Exception as exc:  # noqa: BLE001
        record_error("elementwise", "write_kv setup", exc)
    torch.cuda.empty_cache()


# -- report -------------------------------------------------------------------------------


def table(rows, cols) -> list[str]:
    if not rows:
        return ["  (none)"]

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols]
    lines = ["  " + "  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    for r in rows:
        lines.append("  " + "  ".join(fmt(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)))
    return lines


def write_report() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    RESULTS["elapsed_s"] = time.time() - T0
    (OUT / "kernels.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    lines = [f"llmserve kernel bench on {RESULTS.get('device')} (torch {torch.__version__}, "
             f"triton {RESULTS.get('triton')}), {RESULTS['elapsed_s']:.0f} s", ""]  # fmt: skip
    lines += ["Correctness (max abs error vs the PyTorch reference):"]
    lines += table(RESULTS["checks"], ["name", "max_abs_err", "tol", "ok"])
    lines += ["", "Decode attention (KV read TB/s; bytes = B*ctx*Hkv*D*2*2):"]
    lines += table(RESULTS["decode"], ["batch", "ctx", "impl", "splits", "ms", "tbps", "mode"])
    lines += ["", "Decode split sweep:"]
    lines += table(RESULTS["decode_split_sweep"], ["batch", "ctx", "splits", "ms", "tbps"])
    lines += ["", "Decode tile sweep (block_m 16):"]
    lines += table(
        RESULTS["decode_config_sweep"],
        ["batch", "ctx", "block_n", "num_warps", "num_stages", "ms", "tbps", "max_diff_vs_default"],
    )
    lines += ["", "Prefill (TFLOP/s, causal pairs):"]
    lines += table(RESULTS["prefill"], ["case", "impl", "ms", "tflops", "mode"])
    lines += ["", "Prefill tile sweep (16x1024):"]
    lines += table(
        RESULTS["prefill_config_sweep"],
        ["block_m", "block_n", "num_warps", "num_stages", "ms", "tflops", "max_diff_vs_default"],
    )
    lines += ["", "Long prefill, one sequence (TFLOP/s, causal pairs):"]
    lines += table(
        RESULTS.get("long_prefill", []),
        ["case", "impl", "ms", "tflops", "max_diff_vs_default", "max_diff_vs_reference"],
    )
    lines += ["", "Elementwise kernels:"]
    lines += table(RESULTS["elementwise"], ["kernel", "impl", "ms", "gbps", "mode"])
    lines += ["", f"Errors ({len(RESULTS['errors'])}):"]
    for e in RESULTS["errors"]:
        lines.append(f"  {e['section']}/{e['name']}: {e['error']}")
    text = "\n".join(lines) + "\n"
    (OUT / "kernels.txt").write_text(text)
    print(text)


def main() -> int:
    global BUDGET_S
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=170.0, help="skip remaining timings after this")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and sweeps")
    ap.add_argument(
        "--only",
        default="",
        help="comma list of sections: checks,decode,sweeps,prefill,long,sdpa_lengths,fresh,chunks,elementwise",
    )
    ap.add_argument("--decode-configs", default="", help="e.g. 128x4x2,64x2x3 (block_n x warps x stages)")
    ap.add_argument("--prefill-configs", default="", help="e.g. 128x32x4x3 (block_m x block_n x warps x stages)")
    ap.add_argument("--split-points", default="", help="e.g. 1x8192,16x2048 (batch x ctx) for the split sweep")
    ap.add_argument("--config-points", default="", help="e.g. 1000x1100 (batch x ctx) for the decode tile sweep")
    args = ap.parse_args()
    BUDGET_S = args.budget_s

    def parse(spec):
        return [tuple(int(x) for x in item.split("x")) for item in spec.split(",") if item]

    DECODE_CONFIGS[:] = parse(args.decode_configs)
    PREFILL_CONFIGS[:] = parse(args.prefill_configs)
    SPLIT_POINTS[:] = parse(args.split_points)
    CONFIG_POINTS[:] = parse(args.config_points)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to do", file=sys.stderr)
        return 2
    import triton

    RESULTS["device"] = torch.cuda.get_device_name(0)
    RESULTS["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
    RESULTS["triton"] = triton.__version__
    RESULTS["torch"] = torch.__version__
    sections = [("checks", checks), ("decode", decode), ("sweeps", decode_sweeps),
                ("prefill", prefill), ("long", long_prefill), ("sdpa_lengths", sdpa_new_lengths), ("fresh", fresh_prompts), ("chunks", later_chunks), ("elementwise", lambda q: elementwise())]  # fmt: skip
    only = {s for s in args.only.split(",") if s}
    try:
        for name, fn in sections:
            if only and name not in only:
                continue
            if name != "checks" and over_budget():
                RESULTS["errors"].append({"section": name, "name": "*", "error": "skipped: time budget"})
                continue
            log(f"== {name}")
            try:
                fn(args.quick)
            except Exception as exc:  # noqa: BLE001
                record_error(name, "*", exc)
    finally:
        write_report()
    bad = [c for c in RESULTS["checks"] if not c["ok"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
