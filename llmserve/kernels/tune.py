"""`llmserve tune`: measure the kernels' tunable settings (kernels/tuning.py) on this card and
write them as its settings file, which every engine on the card then starts with.

The search goes setting by setting (each over its candidates, the others at their best so far),
each costed as the summed time of the calls it governs, on a model's projection shapes: the
split-K GEMM's programs and stages at decode's token counts (bf16 at 1 token, FP8 at 1-64) and
the token count up to which FP8 projections take it instead of cuBLAS; the paged attention's decode
tiles and split-KV targets on decode steps of 1 to 256 sequences; the INT8 and W4A16 GEMMs'
split-K rules (kernels/quant_split_k.py) at 1-16 tokens (GGUF's keeps its default). Every
candidate's output is checked against the PyTorch reference first; a wrong one is never chosen.

The fused MoE (`tune_moe`, per experts' shape E,H,I) is searched whole rather than setting by
setting: for each batch bucket (MOE_TOKENS) every grouped tile candidate, checked against the
default tiles' output, then timed; the decode variant's tiles at one token; then the token count
up to which the variant beats the grouped kernels (0: never). Small launches are timed in CUDA
graphs (`graph_timer`). The card's file keeps what an earlier run wrote for other shapes and
modules: each run merges into it.
"""

from __future__ import annotations

import datetime
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from llmserve.kernels import tuning
from llmserve.kernels.paged_attention import AttnLaunchConfig
from llmserve.kernels.quant_split_k import SplitKRule

Timer = Callable[[Callable[[], object]], float]  # seconds one call of the function takes
Call = tuple[str, Callable[[], torch.Tensor], Callable[[], torch.Tensor]]  # (name, the fast call, its reference)


@dataclass(frozen=True)
class Setting:
    module: str
    name: str
    candidates: tuple[Any, ...]
    # the calls that cost it: "gemm" (projections), "attention" (decode batches), "int8" / "w4a16"
    # (the quantized GEMMs at decode)
    workload: str = "gemm"


def _attn(block_n: int, num_stages: int) -> AttnLaunchConfig:
    return AttnLaunchConfig(block_m=16, block_n=block_n, num_warps=4, num_stages=num_stages)


ATTENTION = "llmserve.kernels.paged_attention"
# the quantized GEMMs' split-K rules (kernels/quant_split_k.py): never, or up to 4 / 16 tokens for
# about 128-1,024 programs
SPLIT_K_RULES = (SplitKRule(0, 256), *(SplitKRule(r, p) for r in (4, 16) for p in (128, 256, 512, 1024)))
SEARCH = (
    Setting("llmserve.kernels.split_k_gemm", "SMALL_M_PROGRAMS", (128, 256, 384, 512)),
    Setting("llmserve.kernels.split_k_gemm", "PROGRAMS", (256, 512, 768, 1024)),
    Setting("llmserve.kernels.split_k_gemm", "BF16_STAGES", (2, 3, 4, 5)),
    Setting("llmserve.kernels.split_k_gemm", "SMALL_TILE_ROWS", (1, 4, 8, 16)),
    Setting("llmserve.kernels.fp8_linear", "SMALL_M_ROWS", (8, 16, 32, 48, 64)),
    Setting(ATTENTION, "_DECODE_GPU", tuple(_attn(n, s) for n in (64, 128) for s in (2, 3, 4)), "attention"),
    Setting(ATTENTION, "_DECODE_GPU_LARGE", tuple(_attn(n, s) for n in (32, 64, 128) for s in (2, 3)), "attention"),
    Setting(ATTENTION, "_DECODE_LARGE_PROGRAMS_PER_SM", (4, 8, 16), "attention"),
    Setting(ATTENTION, "PROGRAMS_PER_SM_TARGET", (1, 2, 4), "attention"),
    Setting(ATTENTION, "MIN_TOKENS_PER_SPLIT", (128, 256, 512), "attention"),
    Setting("llmserve.kernels.int8_linear", "SPLIT_K_RULE", SPLIT_K_RULES, "int8"),
    Setting("llmserve.kernels.w4a16_linear", "SPLIT_K_RULE", SPLIT_K_RULES, "w4a16"),
)
DECODE_BATCHES = ((1, 4096), (8, 2048), (64, 1024), (256, 768))  # (sequences, context) of decode steps
FP8_TOKENS = (1, 4, 8, 16, 32, 48, 64, 96)  # the FP8 calls' token counts (96: past the split-K kernel)
QUANT_TOKENS = (1, 4, 8, 16)  # the INT8 / W4A16 Triton GEMMs' token counts (decode)


def projection_shapes(hidden: int, intermediate: int, q_size: int, kv_size: int) -> list[tuple[int, int]]:
    """(N, K) of a decoder layer's projections: qkv, o, gate/up, down."""
    return [(q_size + 2 * kv_size, hidden), (hidden, q_size), (2 * intermediate, hidden), (hidden, intermediate)]


def cuda_timer(reps: int = 20) -> Timer:
    """The median of `reps` timed calls after a warm-up, by CUDA events."""

    def time(fn: Callable[[], object]) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    return time


def graph_timer(calls: int = 10, replays: int = 5) -> Timer:
    """Seconds a call takes, for small kernels (no launch gaps between them): `calls` calls
    captured in one CUDA graph, replayed `replays` times under CUDA events; the median replay
    over `calls`."""

    def time(fn: Callable[[], object]) -> float:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (compile) off the capture
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / calls)
        del graph
        return statistics.median(times)

    return time


def gemm_workload(shapes: Sequence[tuple[int, int]], device: torch.device) -> list[Call]:
    """(name, the fast call, its reference) for each projection: bf16 at 1 token, FP8 at FP8_TOKENS."""
    from llmserve.kernels.fp8_linear import fp8_gemm_fast
    from llmserve.kernels.split_k_gemm import gemm_small_m
    from llmserve.model.fp8 import fp8_gemm_reference, quantize_rows, quantize_tokens

    g = torch.Generator(device="cpu").manual_seed(0)
    calls = []
    for n, k in shapes:
        w = (torch.randn(n, k, generator=g) * 0.02).to(device, torch.bfloat16)
        x1 = torch.randn(1, k, generator=g).to(device, torch.bfloat16)
        calls.append((f"bf16 {n}x{k} m=1", lambda x=x1, w=w: gemm_small_m(x, w),
                      lambda x=x1, w=w: torch.nn.functional.linear(x, w)))  # fmt: skip
        wq, ws = quantize_rows(w)
        for m in FP8_TOKENS:
            xq, xs = quantize_tokens(torch.randn(m, k, generator=g).to(device))
            calls.append((f"fp8 {n}x{k} m={m}",
                          lambda xq=xq, xs=xs, wq=wq, ws=ws: fp8_gemm_fast(xq, xs, wq, ws, torch.bfloat16),
                          lambda xq=xq, xs=xs, wq=wq, ws=ws: fp8_gemm_reference(xq, xs, wq, ws, torch.float32)))  # fmt: skip
    return calls


def int8_workload(shapes: Sequence[tuple[int, int]], device: torch.device) -> list[Call]:
    """(name, the Triton INT8 GEMM, the integer reference) for each projection at QUANT_TOKENS."""
    from llmserve.kernels.int8_linear import int8_gemm_triton
    from llmserve.model.int8 import int8_gemm_reference

    g = torch.Generator(device="cpu").manual_seed(2)
    calls = []
    for n, k in shapes:
        wq = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g).to(device)
        ws = (torch.rand(n, 1, generator=g) * 1e-3).to(device)
        for m in QUANT_TOKENS:
            xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g).to(device)
            xs = (torch.rand(m, 1, generator=g) * 1e-2).to(device)
            calls.append((f"int8 {n}x{k} m={m}",
                          lambda xq=xq, xs=xs, wq=wq, ws=ws: int8_gemm_triton(xq, xs, wq, ws, torch.bfloat16),
                          lambda xq=xq, xs=xs, wq=wq, ws=ws: int8_gemm_reference(xq, xs, wq, ws, torch.float32)))  # fmt: skip
    return calls


def w4a16_workload(shapes: Sequence[tuple[int, int]], device: torch.device, group: int = 128) -> list[Call]:
    """(name, the Triton W4A16 GEMM, dequantize-then-matmul) for each projection at QUANT_TOKENS:
    random 4-bit words, groups of `group` inputs."""
    from llmserve.kernels.w4a16_linear import w4a16_gemm_triton
    from llmserve.model.w4a16 import w4a16_matmul_reference

    g = torch.Generator(device="cpu").manual_seed(3)
    calls = []
    for n, k in shapes:
        qweight = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=g).to(device)
        scales = (torch.rand(n, k // group, generator=g) * 0.01).to(device, torch.float16)
        zeros = torch.randint(0, 16, (n, k // group), dtype=torch.uint8, generator=g).to(device)
        g_idx = (torch.arange(k, dtype=torch.int32) // group).to(device)
        w = (qweight, scales, zeros, g_idx)
        for m in QUANT_TOKENS:
            x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
            calls.append((f"w4a16 {n}x{k} m={m}", lambda x=x, w=w: w4a16_gemm_triton(x, *w),
                          lambda x=x, w=w: w4a16_matmul_reference(x.float(), *w)))  # fmt: skip
    return calls


def attention_workload(num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
                       block_size: int = 16) -> list[Call]:  # fmt: skip
    """(name, the kernels' call, the reference) of a decode step at each of DECODE_BATCHES, bf16."""
    from llmserve.attention_metadata import AttentionMetadata
    from llmserve.kernels.paged_attention import triton_paged_attention
    from llmserve.model.attention import reference_paged_attention

    g = torch.Generator(device="cpu").manual_seed(1)
    calls = []
    for seqs, context in DECODE_BATCHES:
        per_seq = -(-(context + 1) // block_size)
        cache = (torch.randn(2, seqs * per_seq + 1, block_size, num_kv_heads, head_dim, generator=g) * 0.5).to(
            device, torch.bfloat16
        )
        tables = torch.arange(1, seqs * per_seq + 1, dtype=torch.int32).reshape(seqs, per_seq)
        positions = torch.full((seqs,), context, dtype=torch.long)
        slots = tables[:, context // block_size].long() * block_size + context % block_size
        meta = AttentionMetadata(
            slot_mapping=slots.to(device), query_start_loc=torch.arange(seqs + 1, dtype=torch.int32, device=device),
            seq_lens=(positions + 1).to(device, torch.int32), block_tables=tables.to(device), max_query_len=1,
            max_seq_len=context + 1, num_decode_seqs=seqs,
        )  # fmt: skip
        q = torch.randn(seqs, num_heads, head_dim, generator=g).to(device, torch.bfloat16)
        k, v = (torch.randn(seqs, num_kv_heads, head_dim, generator=g).to(device, torch.bfloat16) for _ in range(2))
        scale = head_dim**-0.5
        calls.append((f"decode {seqs} x {context}",
                      lambda q=q, k=k, v=v, c=cache, m=meta: triton_paged_attention(q, k, v, c, m, scale),
                      lambda q=q, k=k, v=v, c=cache, m=meta: reference_paged_attention(q, k, v, c.clone(), m, scale)))  # fmt: skip
    return calls


def search(workloads: dict[str, Sequence[Call]], timer: Timer, settings: Sequence[Setting] = SEARCH,
           check: bool = True, progress: Callable[[str], None] = print) -> dict[str, dict[str, Any]]:  # fmt: skip
    """The best value of each setting in turn (the others at their best so far), costed on its
    workload's calls; returns the values that differ from the defaults' (module -> name -> value).
    The modules' settings are the defaults again afterwards."""
    chosen: dict[str, dict[str, Any]] = {}
    refs = {(w, name): ref().float() for w, calls in workloads.items() for name, _, ref in calls} if check else {}
    try:
        for setting in settings:
            calls = workloads.get(setting.workload)
            if not calls:
                continue
            costs = {}
            for value in setting.candidates:
                trial = {**chosen, setting.module: {**chosen.get(setting.module, {}), setting.name: value}}
                tuning.set_values(trial)
                if check and not all(_close(fast(), refs[setting.workload, name]) for name, fast, _ in calls):
                    progress(f"  {setting.name} = {value}: wrong output, skipped")
                    continue
                costs[value] = sum(timer(fast) for _, fast, _ in calls)
                progress(f"  {setting.name} = {value}: {costs[value] * 1e3:.3f} ms")
            if not costs:
                raise RuntimeError(f"no candidate of {setting.module}.{setting.name} gave the reference's output")
            best = min(costs, key=costs.get)
            chosen.setdefault(setting.module, {})[setting.name] = best
            progress(f"{setting.module}.{setting.name}: {best}")
    finally:
        tuning.set_values({})
    base = tuning.defaults()
    changed = {m: {n: v for n, v in names.items() if base[m][n] != v} for m, names in chosen.items()}
    return {m: names for m, names in changed.items() if names}


# the fused MoE's search: batch buckets (token counts; a step takes the smallest bucket that holds
# it, the last every larger one) and the grouped kernels' tile candidates at each
MOE_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 4096, 16384)
MOE_BLOCK_M = (16, 32, 64, 128)  # 16 only up to 512 tokens, 128 only from 1,024
MOE_BLOCK_NK = ((64, 64), (64, 128), (128, 64), (128, 128))
MOE_WARPS = (4, 8)
MOE_STAGES = (3, 4)
# the decode variant's candidates (at one token) and the counts it may be chosen up to
MOE_DECODE_BLOCK_N = (16, 32, 64)  # BLOCK_N and DOWN_BLOCK_N each
MOE_DECODE_BLOCK_K = (64, 128, 256)
MOE_DECODE_TOKENS = (1, 2, 4, 8)
MOE_TOLERANCE = 1e-2  # a candidate's relative error against the default tiles' output


def moe_tile_candidates(tokens: int, block_m: Sequence[int] = MOE_BLOCK_M,
                        block_nk: Sequence[tuple[int, int]] = MOE_BLOCK_NK, warps: Sequence[int] = MOE_WARPS,
                        stages: Sequence[int] = MOE_STAGES) -> list[dict[str, int]]:  # fmt: skip
    """The grouped kernels' tiles tried at a bucket of `tokens`: BLOCK_M 16 only up to 512 tokens
    (few rows an expert), 128 only from 1,024."""
    ms = [m for m in block_m if not (m == 16 and tokens > 512) and not (m == 128 and tokens < 1024)]
    return [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
            for m in ms for n, k in block_nk for w in warps for s in stages]  # fmt: skip


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.float()
    return ((got.float() - want).norm() / want.norm().clamp(min=1e-12)).item()


def tune_moe(num_experts: int, hidden: int, intermediate: int, top_k: int, device: torch.device | str, timer: Timer,
             progress: Callable[[str], None] = print, *, tokens: Sequence[int] = MOE_TOKENS,
             block_m: Sequence[int] = MOE_BLOCK_M, block_nk: Sequence[tuple[int, int]] = MOE_BLOCK_NK,
             warps: Sequence[int] = MOE_WARPS, stages: Sequence[int] = MOE_STAGES,
             decode_block_n: Sequence[int] = MOE_DECODE_BLOCK_N, decode_block_k: Sequence[int] = MOE_DECODE_BLOCK_K,
             decode_tokens: Sequence[int] = MOE_DECODE_TOKENS, dtype: torch.dtype = torch.bfloat16,
             seed: int = 0) -> dict[str, dict[str, Any]]:  # fmt: skip
    """The fused MoE's tables for experts of this shape on this card: {"TUNED_TILES": {key: bucket
    -> tiles}, "TUNED_DECODE": {key: decode settings}} (key: `fused_moe.shape_key`). Each
    candidate runs `fused_moe` on random inputs (router logits random, weights randn * dim**-0.5)
    and must give the default tiles' output (relative error under MOE_TOLERANCE) before it is
    timed; a wrong one is skipped, never chosen. The module's tables are as before afterwards."""
    from llmserve.kernels import fused_moe as fm

    dev = torch.device(device)
    key = fm.shape_key(num_experts, hidden, intermediate)
    g = torch.Generator(device="cpu").manual_seed(seed)
    most = max([*tokens, *decode_tokens])
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden, generator=g) * hidden**-0.5).to(dev, dtype)
    w2 = (torch.randn(num_experts, hidden, intermediate, generator=g) * intermediate**-0.5).to(dev, dtype)
    xs = torch.randn(most, hidden, generator=g).to(dev, dtype)
    logits = torch.randn(most, num_experts, generator=g).to(dev, dtype)

    def moe(t: int, **kw: Any) -> Callable[[], torch.Tensor]:
        x, lg = xs[:t], logits[:t]
        return lambda: fm.fused_moe(x, lg, w13, w2, top_k, True, **kw)

    def default_output(t: int) -> torch.Tensor:
        return moe(t, tiles=fm.bucket_tiles(fm.DEFAULT_TILES, t), decode=False)()

    def checked_time(run: Callable[[], torch.Tensor], want: torch.Tensor, label: str) -> float | None:
        """`run`'s time, if its output is the default tiles' `want` (else None: a wrong candidate, or
        one the card cannot hold, failing at its compile or launch, is ruled out, never chosen)."""
        try:
            err = _rel_err(run(), want)
            if not err < MOE_TOLERANCE:
                progress(f"  {label}: wrong output (relative error {err:.2g}), skipped")
                return None
            return timer(run)
        except Exception as exc:  # noqa: BLE001  (any failure of a candidate only rules it out)
            progress(f"  {label}: failed ({type(exc).__name__}: {str(exc)[:120]}), skipped")
            return None

    saved = fm.TUNED_TILES, fm.TUNED_DECODE
    try:
        fm.TUNED_TILES, fm.TUNED_DECODE = {}, {}
        table: dict[int, dict[str, int]] = {}
        for t in tokens:
            want = default_output(t)
            costs = []
            for cfg in moe_tile_candidates(t, block_m, block_nk, warps, stages):
                cost = checked_time(moe(t, tiles=cfg, decode=False), want, f"T={t} {cfg}")
                if cost is not None:
                    costs.append((cost, cfg))
                    progress(f"  T={t} {cfg}: {cost * 1e6:.1f} us")
            if not costs:
                raise RuntimeError(f"fused MoE {key}: no tile candidate at {t} tokens gave the default tiles' output")
            table[t] = min(costs, key=lambda c: c[0])[1]
            progress(f"fused MoE {key} T={t}: {table[t]}")

        def timed_decode(cfg: dict[str, int], t: int) -> float | None:
            """The variant's time at `t` tokens with `cfg` (None: a wrong output)."""
            fm.TUNED_DECODE = {key: cfg}
            return checked_time(moe(t, decode=True), default_output(t), f"decode T={t} {cfg}")

        decode_costs = []
        for bn in decode_block_n:
            for down_bn in decode_block_n:
                for bk in decode_block_k:
                    cfg = dict(fm.DEFAULT_DECODE, BLOCK_N=bn, DOWN_BLOCK_N=down_bn, BLOCK_K=bk, num_warps=4,
                               num_stages=2)  # fmt: skip
                    cost = timed_decode(cfg, 1)
                    if cost is not None:
                        decode_costs.append((cost, cfg))
                        progress(f"  decode T=1 {cfg}: {cost * 1e6:.1f} us")
        fm.TUNED_TILES = {key: table}
        max_tokens, best = 0, dict(fm.DEFAULT_DECODE)
        if decode_costs:
            best = dict(min(decode_costs, key=lambda c: c[0])[1])
            for t in decode_tokens:  # contiguous from the first: the largest count the variant wins at
                fm.TUNED_DECODE = {}
                grouped = timer(moe(t, tiles=fm.tile_config(t, num_experts, hidden, intermediate), decode=False))
                decoded = timed_decode(best, t)
                progress(f"  T={t}: decode {'wrong' if decoded is None else f'{decoded * 1e6:.1f} us'}, "
                         f"grouped {grouped * 1e6:.1f} us")  # fmt: skip
                if decoded is None or decoded >= grouped:
                    break
                max_tokens = t
        best["max_tokens"] = max_tokens
        progress(f"fused MoE {key} decode: {best}")
    finally:
        fm.TUNED_TILES, fm.TUNED_DECODE = saved
    return {"TUNED_TILES": {key: table}, "TUNED_DECODE": {key: best}}


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    scale = want.abs().amax().clamp(min=1e-6)
    return bool(((got.float() - want).abs().amax() / scale) < 2e-2)


MOE_MODULE = "llmserve.kernels.fused_moe"


def merge_settings(old: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]],
                   dense: bool) -> dict[str, dict[str, Any]]:  # fmt: skip
    """A card's file after a run: the MoE tables merged by shape (a second model's shapes join the
    first's); the other modules' settings replaced by this run's search when it ran one (`dense`),
    else kept."""
    out = {m: dict(names) for m, names in old.items() if not (dense and m != MOE_MODULE)}
    for module_name, names in new.items():
        for name, value in names.items():
            kept = out.setdefault(module_name, {})
            kept[name] = {**kept.get(name, {}), **value} if module_name == MOE_MODULE else value
    return {m: names for m, names in out.items() if names}


def run(hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int, device: str = "cuda",
        num_experts: int | None = None, moe_intermediate: int | None = None, top_k: int | None = None,
        only: str = "all", moe_tokens: Sequence[int] | None = None) -> tuple[str, dict]:  # fmt: skip
    """Tune on `device` and merge into the card's file: (its path, this run's values). `only`:
    "dense" (projections and attention), "moe" (the fused MoE of experts num_experts x
    moe_intermediate, top_k a token), or "all" (both; the MoE where its shape is given)."""
    if only not in ("all", "dense", "moe"):
        raise ValueError(f"only must be all, dense or moe, not {only!r}")
    moe = None if num_experts is None else (num_experts, moe_intermediate, top_k)
    if moe is not None and (moe_intermediate is None or top_k is None):
        raise ValueError("the MoE shape needs num_experts, moe_intermediate and top_k")
    if only == "moe" and moe is None:
        raise ValueError("tuning the MoE alone needs the experts' shape (--num-experts, "
                         "--moe-intermediate-size, --num-experts-per-tok, or --model of a MoE model)")  # fmt: skip
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise SystemExit("llmserve tune measures kernels on a CUDA device (settings are per card); none is here")
    card = tuning.card_key(dev)
    print(f"tuning the kernels' settings on {card} ({torch.cuda.get_device_name(dev)})")
    values: dict[str, dict[str, Any]] = {}
    what = []
    if only in ("all", "dense"):
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        shapes = projection_shapes(hidden, intermediate, q_size, kv_size)
        workloads = {
            "gemm": gemm_workload(shapes, dev),
            "attention": attention_workload(num_heads, kv_size // head_dim, head_dim, dev),
            "int8": int8_workload(shapes, dev),
            "w4a16": w4a16_workload(shapes, dev),
        }
        values = search(workloads, cuda_timer())
        what.append(f"projections hidden {hidden}, intermediate {intermediate}")
    if moe is not None and only in ("all", "moe"):
        values[MOE_MODULE] = tune_moe(
            num_experts, hidden, moe_intermediate, top_k, dev, graph_timer(), tokens=tuple(moe_tokens or MOE_TOKENS)
        )
        what.append(f"MoE {num_experts} experts x {moe_intermediate}, top {top_k}")
    old_path = tuning.settings_file(card)
    old = tuning.read_settings(old_path) if old_path is not None else {}
    merged = merge_settings(old, values, dense=only in ("all", "dense"))
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    path = tuning.write_settings(card, merged, f"{stamp}, {'; '.join(what)}")
    return str(path), values
