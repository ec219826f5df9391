"""One bf16 batch-1 decode step of the 8B shape as the engine's kernels run it (32 layers of
norm, qkv, rotary, KV write, paged attention and its reduce, o, add + norm, gate/up, SiLU, down;
then the final norm and the LM head), captured in one CUDA graph and replayed: with and without
programmatic dependent launch (llmserve/kernels/pdl.py), and with cuBLAS or the split-K kernel
for qkv and gate/up. Every variant's logits are compared with the plain variant's (PDL changes no
result: equal bit for bit) and timed per step. Writes $OUT/pdl_chain_micro.json.

    python3 scripts/gpu/pdl_chain_micro.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from event_timer import median_ms  # noqa: E402

from llmserve.attention_metadata import AttentionMetadata  # noqa: E402
from llmserve.kernels import pdl, split_k_gemm  # noqa: E402
from llmserve.kernels.activation import silu_and_mul  # noqa: E402
from llmserve.kernels.cache_write import write_kv  # noqa: E402
from llmserve.kernels.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from llmserve.kernels.paged_attention import paged_attention_forward  # noqa: E402
from llmserve.kernels.rotary import apply_rotary  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
LAYERS, HIDDEN, INTER, HEADS, KV_HEADS, D, VOCAB = 32, 4096, 14336, 32, 8, 128, 128256
CONTEXT, PAGE, STEPS = 768, 16, 20  # batch 1 at 512 + 256 tokens; 20 steps a graph
DEV = torch.device("cuda")


def weights() -> dict:
    g = torch.Generator(device=DEV).manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, device=DEV, generator=g, dtype=torch.bfloat16) * 0.02).contiguous()

    layers = [{"qkv": w((HEADS + 2 * KV_HEADS) * D, HIDDEN), "o": w(HIDDEN, HIDDEN), "gate_up": w(2 * INTER, HIDDEN),
               "down": w(HIDDEN, INTER), "ln1": 1 + w(HIDDEN), "ln2": 1 + w(HIDDEN),
               "cache": torch.randn(2, CONTEXT // PAGE + 1, PAGE, KV_HEADS, D, device=DEV, generator=g,
                                    dtype=torch.bfloat16)} for _ in range(LAYERS)]  # fmt: skip
    return {"layers": layers, "norm": 1 + w(HIDDEN), "lm_head": w(VOCAB, HIDDEN)}


def step(model: dict, x: torch.Tensor, meta: AttentionMetadata, positions, cos_sin, split_k: set[str]) -> torch.Tensor:
    def linear(name: str, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if name == "gate_up" and {"gate_up64", "gate_up64s2"} & split_k:  # 64-wide tiles, K whole or in 2
            return split_k_gemm.gemm_small_m(h, weight, block_n=64, block_k=128, split_k=2 if "gate_up64s2" in split_k
                                             else 1, num_warps=4, num_stages=4)  # fmt: skip
        return split_k_gemm.gemm_small_m(h, weight) if name in split_k else F.linear(h, weight)

    residual = x
    h = rms_norm(x, model["layers"][0]["ln1"], 1e-5)
    for i, layer in enumerate(model["layers"]):
        if i:
            h, residual = fused_add_rms_norm(h, residual, layer["ln1"], 1e-5)
        qkv = linear("qkv", h, layer["qkv"])
        q, k, v = qkv.split([HEADS * D, KV_HEADS * D, KV_HEADS * D], dim=-1)
        q, k = apply_rotary(q.view(1, HEADS, D), k.view(1, KV_HEADS, D), positions, cos_sin)
        write_kv(k, v.view(1, KV_HEADS, D), layer["cache"], meta.slot_mapping)
        attn = paged_attention_forward(q, layer["cache"], meta, D**-0.5)
        h = linear("o", attn.view(1, HIDDEN), layer["o"])
        h, residual = fused_add_rms_norm(h, residual, layer["ln2"], 1e-5)
        h = linear("down", silu_and_mul(linear("gate_up", h, layer["gate_up"])), layer["down"])
    h, _ = fused_add_rms_norm(h, residual, model["norm"], 1e-5)
    return linear("lm_head", h, model["lm_head"])


def main() -> None:
    model = weights()
    blocks = CONTEXT // PAGE + 1
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([CONTEXT - 1], dtype=torch.long, device=DEV),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor([CONTEXT], dtype=torch.int32, device=DEV),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=DEV)[None],
        max_query_len=1, max_seq_len=2048, num_decode_seqs=1,
    )  # fmt: skip
    positions = torch.tensor([CONTEXT - 1], dtype=torch.long, device=DEV)
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=DEV).float() / D))
    ang = torch.outer(torch.arange(4096, device=DEV).float(), inv)
    cos_sin = torch.stack([torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)]).contiguous()
    x = torch.randn(1, HIDDEN, device=DEV, dtype=torch.bfloat16)
    print("pdl supported:", pdl.pdl_supported(DEV), flush=True)
    engine_set = {"qkv", "o", "down", "lm_head"}  # bf16_config today
    variants = {
        "plain": (False, engine_set),
        "pdl": (True, engine_set),
        "pdl_gate_up": (True, engine_set | {"gate_up"}),
        "pdl_gate_up64": (True, engine_set | {"gate_up64"}),
        "pdl_gate_up64s2": (True, engine_set | {"gate_up64s2"}),
        "pdl_qkv_cublas": (True, engine_set - {"qkv"}),
        "pdl_gate_up_qkv_cublas": (True, (engine_set | {"gate_up"}) - {"qkv"}),
        "plain_qkv_cublas": (False, engine_set - {"qkv"}),
        "plain_gate_up": (False, engine_set | {"gate_up"}),
    }
    results, reference = {}, None
    for name, (use_pdl, split_k) in variants.items():
        pdl.ENABLED = use_pdl
        try:
            caches = [layer["cache"].clone() for layer in model["layers"]]
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for _ in range(2):
                    logits = step(model, x, meta, positions, cos_sin, split_k)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(STEPS):
                    logits = step(model, x, meta, positions, cos_sin, split_k)
            graph.replay()
            torch.cuda.synchronize()
            if reference is None:
                reference = logits.clone()
            same = bool(torch.equal(logits, reference))
            err = (logits.float() - reference.float()).abs().max().item()
            ms = median_ms(graph.replay, iters=5, warmup=0) / STEPS
            results[name] = {"pdl": use_pdl, "split_k": sorted(split_k), "ms_per_step": round(ms, 4),
                             "equal_to_plain": same, "max_abs_diff": err}  # fmt: skip
            for layer, c in zip(model["layers"], caches):
                layer["cache"].copy_(c)
            del graph
        except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, the others still run
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(name, results[name], flush=True)
    (OUT / "pdl_chain_micro.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
