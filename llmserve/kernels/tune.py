"""`llmserve tune`: measure the kernels' tunable settings (kernels/tuning.py) on this card and
write them as its settings file, which every engine on the card then starts with.

The search goes setting by setting (each over its candidates, the others at their best so far),
each costed as the summed time of the calls it governs, on a model's projection shapes: the
split-K GEMM's programs and stages at decode's token counts (bf16 at 1 token, FP8 at 1-64) and
the token count up to which FP8 projections take it instead of cuBLAS; the paged attention's decode
tiles and split-KV targets on decode steps of 1 to 256 sequences; the INT8 and W4A16 GEMMs'
split-K rules (kernels/quant_split_k.py) at 1-16 tokens (GGUF's keeps its default). Every
candidate's output is checked against the PyTorch reference first; a wrong one is never chosen.
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


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    scale = want.abs().amax().clamp(min=1e-6)
    return bool(((got.float() - want).abs().amax() / scale) < 2e-2)


def run(hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int,
        device: str = "cuda") -> tuple[str, dict]:  # fmt: skip
    """Tune on `device` for these projection sizes and write the card's file: (its path, values)."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise SystemExit("llmserve tune measures kernels on a CUDA device (settings are per card); none is here")
    card = tuning.card_key(dev)
    print(f"tuning the kernels' settings on {card} ({torch.cuda.get_device_name(dev)})")
    shapes = projection_shapes(hidden, intermediate, q_size, kv_size)
    workloads = {
        "gemm": gemm_workload(shapes, dev),
        "attention": attention_workload(num_heads, kv_size // head_dim, head_dim, dev),
        "int8": int8_workload(shapes, dev),
        "w4a16": w4a16_workload(shapes, dev),
    }
    values = search(workloads, cuda_timer())
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    path = tuning.write_settings(card, values, f"{stamp}, projections hidden {hidden}, intermediate {intermediate}")
    return str(path), values
