"""The LoRA Triton kernels compiled on the GPU (issue 22), run on the device machine.

1. Correctness at Llama-3.1-8B shapes (hidden 4096, q 4096, k/v 1024, MLP 14336) in float32,
   float16 and bfloat16 against the PyTorch reference, for 1 to 2048 tokens spread over 8 slots
   of ranks 8 and 16 (max rank 16) plus tokens without an adapter.
2. CUDA graphs: a LoRALinear (qkv_proj) captured once with every token on the base model and
   `always_apply`, replayed with other mixes of adapters, equals the eager result.
3. A first timing (not a benchmark): shrink + expand of qkv_proj and down_proj against the base
   bf16 GEMM of the same projection, each inside a CUDA graph of 20 calls (launch costs not
   counted, as in the engine's decode graphs), CUDA events, median of 20 replays.
4. The adapter on a second stream beside the base GEMM (LoRALinear's overlap, 1 and 8 tokens):
   the same output as in order, bit for bit, eager and replayed from a CUDA graph; and a whole
   projection (base GEMM, in order, overlapped) timed as in 3.
Writes $OUT/lora_kernels_check.json. LORA_CHECK=overlap runs step 4 alone.

    python3 scripts/gpu/lora_kernels_check.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from llmserve.kernels.lora import lora_expand, lora_shrink  # noqa: E402
from llmserve.lora.apply import LoRALinear  # noqa: E402
from llmserve.lora.context import LoRAContext  # noqa: E402
from llmserve.lora.expand_gemm import lora_expand_gemm  # noqa: E402
from llmserve.lora.ops import triton_lora_ops  # noqa: E402
from llmserve.lora.reference import lora_expand_reference, lora_shrink_reference  # noqa: E402
from llmserve.lora.slot_weights import ProjectionLoRA  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
DEV = torch.device("cuda")
SLOTS, MAX_RANK = 8, 16
PROJ = {"qkv_proj": (4096, [4096, 1024, 1024]), "o_proj": (4096, [4096]), "gate_up_proj": (4096, [14336, 14336]),
        "down_proj": (14336, [4096])}  # fmt: skip


def weights(in_features: int, widths: list[int], dtype: torch.dtype, gen: torch.Generator) -> ProjectionLoRA:
    a = torch.zeros(SLOTS, len(widths), MAX_RANK, in_features, device=DEV)
    b = torch.zeros(SLOTS, sum(widths), MAX_RANK, device=DEV)
    for s in range(SLOTS):
        rank = 16 if s % 2 else 8
        a[s, :, :rank] = torch.randn(len(widths), rank, in_features, generator=gen, device=DEV) / in_features**0.5
        b[s, :, :rank] = torch.randn(sum(widths), rank, generator=gen, device=DEV) / rank**0.5
    offsets = torch.tensor([0, *torch.tensor(widths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    scaling = torch.rand(SLOTS, generator=gen, device=DEV) + 0.5
    return ProjectionLoRA(a.to(dtype), b.to(dtype), scaling, offsets, max(widths), tuple(offsets.tolist()))


def token_slots(n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(-1, SLOTS, (n,), generator=gen, device="cpu").tolist()


def max_abs(d: torch.Tensor) -> float:
    return d.abs().max().item() if d.numel() else 0.0


def check_correctness() -> list[dict]:
    rows = []
    gen = torch.Generator(device=DEV).manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for name, (in_features, widths) in PROJ.items():
            w = weights(in_features, widths, dtype, gen)
            for n in (1, 7, 64, 300, 2048):
                ctx = LoRAContext(4096, SLOTS, DEV)
                slots = token_slots(n, cpu_gen)
                ctx.set_token_slots(slots)
                batch = ctx.batch(n)
                rows_used = torch.tensor([s >= 0 for s in slots], device=DEV)  # the shrink writes only these
                x = torch.randn(n, in_features, generator=gen, device=DEV).to(dtype)
                t, t_ref = lora_shrink(x, w.a, w.scaling, batch), lora_shrink_reference(x, w.a, w.scaling, batch)
                y0 = torch.randn(n, sum(widths), generator=gen, device=DEV).to(dtype)
                y, y_ref, y_split = y0.clone(), y0.clone(), y0.clone()
                lora_expand(y, t_ref, w.b, w.slice_offsets, w.max_slice_width, batch)
                lora_expand(y_split, t, w.b, w.slice_offsets, w.max_slice_width, batch)  # the partial sums
                y_gemm = y0.clone()
                lora_expand_gemm(y_gemm, t, w.b_all, w.slice_bounds, batch)  # (b_all: a copy here)
                lora_expand_reference(y_ref, t_ref, w.b, w.slice_offsets, w.max_slice_width, batch)
                torch.cuda.synchronize()
                rows.append({"dtype": str(dtype).removeprefix("torch."), "proj": name, "tokens": n,
                             "splits": t.shape[0],
                             "shrink_max_abs": max_abs(t.sum(0)[rows_used] - t_ref[rows_used]),
                             "expand_split_max_abs": (y_split.float() - y_ref.float()).abs().max().item(),
                             "expand_gemm_max_abs": (y_gemm.float() - y_ref.float()).abs().max().item(),
                             "shrink_ref_max": t_ref.abs().max().item(),
                             "expand_max_abs": (y.float() - y_ref.float()).abs().max().item(),
                             "delta_max": (y_ref.float() - y0.float()).abs().max().item()})  # fmt: skip
                print("RESULT correctness", rows[-1], flush=True)
    return rows


def replayed_max_abs(captured, reference, x: torch.Tensor, new_slots, replays: int) -> float:
    """`captured(x)` captured once in a CUDA graph, then `replays` times: new token slots
    (`new_slots()`), a replay, and the largest difference from `reference(x)` run eagerly."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = captured(x)
    worst = 0.0
    for _ in range(replays):
        new_slots()
        graph.replay()
        want = reference(x)
        torch.cuda.synchronize()
        worst = max(worst, (out.float() - want.float()).abs().max().item())
    return worst


def check_graphs() -> dict:
    gen = torch.Generator(device=DEV).manual_seed(1)
    cpu_gen = torch.Generator().manual_seed(1)
    in_features, widths = PROJ["qkv_proj"]
    base = torch.nn.Linear(in_features, sum(widths), bias=False, device=DEV, dtype=torch.bfloat16)
    n = 64
    ctx = LoRAContext(256, SLOTS, DEV, always_apply=True)
    layer = LoRALinear(base, weights(in_features, widths, torch.bfloat16, gen), ctx, triton_lora_ops())
    x = torch.randn(n, in_features, generator=gen, device=DEV).to(torch.bfloat16)
    ctx.set_token_slots([-1] * n)
    with torch.inference_mode():
        layer(x)  # compile outside the capture
        # (3 padding rows: no slot)
        worst = replayed_max_abs(layer, layer, x, lambda: ctx.set_token_slots(token_slots(n - 3, cpu_gen)), 5)
    result = {"graph_vs_eager_max_abs": worst}
    print("RESULT graphs", result, flush=True)
    return result


def time_ms(fn, calls: int = 20) -> float:
    """Milliseconds a call, `calls` calls captured in one CUDA graph (as the
    engine's decode steps run them: no launch cost counted), median of 20 replays."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def timings() -> list[dict]:
    rows = []
    gen = torch.Generator(device=DEV).manual_seed(2)
    for name in PROJ:
        in_features, widths = PROJ[name]
        w = weights(in_features, widths, torch.bfloat16, gen)
        base = torch.randn(sum(widths), in_features, generator=gen, device=DEV).to(torch.bfloat16)
        for n in (1, 8, 64, 256, 512, 2048):
            ctx = LoRAContext(4096, SLOTS, DEV)
            ctx.set_token_slots([i % SLOTS for i in range(n)])  # every token on an adapter, 8 adapters
            batch = ctx.batch(n)
            x = torch.randn(n, in_features, generator=gen, device=DEV).to(torch.bfloat16)
            y = x @ base.t()
            shrink = time_ms(lambda: lora_shrink(x, w.a, w.scaling, batch))
            unsplit = time_ms(lambda: lora_shrink(x, w.a, w.scaling, batch, splits=1))
            t = lora_shrink(x, w.a, w.scaling, batch)
            expand = time_ms(lambda: lora_expand(y, t, w.b, w.slice_offsets, w.max_slice_width, batch))
            b_all = w.b_all.contiguous()  # as an output-major store holds it (a view there)
            expand_gemm = time_ms(lambda: lora_expand_gemm(y, t, b_all, w.slice_bounds, batch))
            gemm = time_ms(lambda: x @ base.t())
            rows.append({"proj": name, "tokens": n, "splits": t.shape[0], "shrink_ms": shrink,
                         "shrink_unsplit_ms": unsplit, "expand_ms": expand, "expand_gemm_ms": expand_gemm,
                         "base_gemm_ms": gemm})  # fmt: skip
            print("RESULT timing", rows[-1], flush=True)
    return rows


def check_overlap() -> list[dict]:
    gen = torch.Generator(device=DEV).manual_seed(3)
    cpu_gen = torch.Generator().manual_seed(3)
    side = torch.cuda.Stream(DEV)
    rows = []
    for name, (in_features, widths) in PROJ.items():
        base = torch.nn.Linear(in_features, sum(widths), bias=False, device=DEV, dtype=torch.bfloat16)
        w = weights(in_features, widths, torch.bfloat16, gen)
        for n in (1, 8):
            ctx = LoRAContext(256, SLOTS, DEV, always_apply=True)
            plain = LoRALinear(base, w, ctx, triton_lora_ops())
            over = LoRALinear(base, w, ctx, triton_lora_ops(overlap_max_tokens=16), side=side)
            x = torch.randn(n, in_features, generator=gen, device=DEV).to(torch.bfloat16)
            with torch.inference_mode():
                ctx.set_token_slots(token_slots(n, cpu_gen))
                eager_diff = (plain(x).float() - over(x).float()).abs().max().item()
                graph_diff = replayed_max_abs(over, plain, x, lambda: ctx.set_token_slots(token_slots(n, cpu_gen)), 3)
                ctx.set_token_slots([i % SLOTS for i in range(n)])
                times = {"base_ms": time_ms(lambda: base(x)), "in_order_ms": time_ms(lambda: plain(x)),
                         "overlapped_ms": time_ms(lambda: over(x))}  # fmt: skip
            rows.append({"proj": name, "tokens": n, "eager_max_abs": eager_diff, "graph_max_abs": graph_diff, **times})
            print("RESULT overlap", rows[-1], flush=True)
    return rows


def main() -> None:
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    if os.environ.get("LORA_CHECK") == "overlap":
        report = {"overlap": check_overlap()}
    else:
        report = {"correctness": check_correctness(), "graphs": check_graphs(), "timings": timings(),
                  "overlap": check_overlap()}  # fmt: skip
    (OUT / "lora_kernels_check.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
