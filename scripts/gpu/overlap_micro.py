"""Can decode attention hide under the GEMMs? (issue 18, (a): the serial bound is ~11,560 tok/s.)

One decode step of the bf16 8B shape (the four projections by cuBLAS, the paged-attention kernel
over B sequences of CTX cached tokens, SiLU-and-mul) as a CUDA graph, run as:
- `full`: the whole batch, kernel after kernel (the engine today);
- `halves_serial`: two half batches, one after the other in each layer (what splitting costs);
- `halves_streams[_cN]`: the two halves on two streams, the second started one phase behind,
  with cuBLAS kept off N SMs (`torch._C._set_sm_carveout_experimental`) so that the
  attention of one half finds SMs free beside the other half's GEMMs;
- `gemms` / `attention`: only the GEMMs, only the attention (the serial parts).
Every variant's output is compared with `full`'s. Writes $OUT/overlap_micro.json.

    B=512 CTX=640 LAYERS=32 python3 scripts/gpu/overlap_micro.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from llmserve.attention_metadata import AttentionMetadata  # noqa: E402
from llmserve.kernels.activation import silu_and_mul  # noqa: E402
from llmserve.kernels.paged_attention import paged_attention_forward  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
B = int(os.environ.get("B", "512"))
CTX = int(os.environ.get("CTX", "640"))
LAYERS = int(os.environ.get("LAYERS", "32"))
CARVEOUTS = tuple(int(c) for c in os.environ.get("CARVEOUTS", "0,16,32,48,66").split(","))
H, HQ, HKV, D, FF, PAGE = 4096, 32, 8, 128, 14336, 16
DT = torch.bfloat16
DEV = "cuda"


def make_meta(batch: int, first_block: int, blocks_per_seq: int) -> AttentionMetadata:
    bt = (first_block + torch.arange(batch * blocks_per_seq, dtype=torch.int32, device=DEV)).view(batch, -1)
    return AttentionMetadata(
        slot_mapping=torch.full((batch,), -1, dtype=torch.long, device=DEV),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=DEV),
        seq_lens=torch.full((batch,), CTX, dtype=torch.int32, device=DEV),
        block_tables=bt, max_query_len=1, max_seq_len=CTX, num_decode_seqs=batch)  # fmt: skip


class Step:
    def __init__(self) -> None:
        g = torch.Generator(device=DEV).manual_seed(0)

        def w(n: int, k: int) -> torch.Tensor:
            return (torch.randn(n, k, device=DEV, dtype=DT, generator=g) * k ** -0.5)

        self.wqkv = [w(HQ * D + 2 * HKV * D, H) for _ in range(LAYERS)]
        self.wo = [w(H, HQ * D) for _ in range(LAYERS)]
        self.wgu = [w(2 * FF, H) for _ in range(LAYERS)]
        self.wd = [w(H, FF) for _ in range(LAYERS)]
        bps = -(-CTX // PAGE)
        self.caches = [torch.randn(2, B * bps, PAGE, HKV, D, device=DEV, dtype=DT, generator=g) for _ in range(LAYERS)]
        self.meta = {"all": make_meta(B, 0, bps), "h0": make_meta(B // 2, 0, bps),
                     "h1": make_meta(B - B // 2, (B // 2) * bps, bps)}  # fmt: skip
        self.x = torch.randn(B, H, device=DEV, dtype=DT, generator=g)
        self.out = torch.empty_like(self.x)

    def qkv(self, x, layer):
        return F.linear(x, self.wqkv[layer])

    def attend(self, qkv, layer, part):
        q = qkv[:, : HQ * D].view(-1, HQ, D)
        return paged_attention_forward(q, self.caches[layer], self.meta[part], D ** -0.5).view(-1, HQ * D)

    def mlp(self, a, x, layer):
        h = x + F.linear(a, self.wo[layer])
        return h + F.linear(silu_and_mul(F.linear(h, self.wgu[layer])), self.wd[layer])

    def chain(self, x, part):
        for layer in range(LAYERS):
            x = self.mlp(self.attend(self.qkv(x, layer), layer, part), x, layer)
        return x

    # the variants: each writes its result to self.out
    def full(self):
        self.out.copy_(self.chain(self.x, "all"))

    def halves_serial(self):
        n = B // 2
        xs = [self.x[:n], self.x[n:]]
        for layer in range(LAYERS):
            for i, part in enumerate(("h0", "h1")):
                xs[i] = self.mlp(self.attend(self.qkv(xs[i], layer), layer, part), xs[i], layer)
        self.out[:n].copy_(xs[0])
        self.out[n:].copy_(xs[1])

    def halves_streams(self):
        """Half 1 runs one phase behind half 0, on its own stream: the attention of one lines up
        with the other's GEMMs (the GPU interleaves what it can; no event pairs the phases)."""
        n = B // 2
        main = torch.cuda.current_stream()
        side = self.side
        side.wait_stream(main)
        x0, x1 = self.x[:n], self.x[n:]
        with torch.cuda.stream(side):
            x1_qkv = self.qkv(x1, 0)  # half 1's first GEMM while half 0 ...
        for layer in range(LAYERS):
            x0 = self.mlp(self.attend(self.qkv(x0, layer), layer, "h0"), x0, layer)
            with torch.cuda.stream(side):
                x1 = self.mlp(self.attend(x1_qkv, layer, "h1"), x1, layer)
                if layer + 1 < LAYERS:
                    x1_qkv = self.qkv(x1, layer + 1)
        self.out[:n].copy_(x0)
        with torch.cuda.stream(side):
            self.out[n:].copy_(x1)
        main.wait_stream(side)

    def paired(self):
        """The halves in lockstep: the attention of one half and the GEMMs of the other are
        launched together, on two streams, phase by phase (NanoFlow's pairing)."""
        n = B // 2
        main = torch.cuda.current_stream()
        side = self.side
        side.wait_stream(main)
        x0, x1 = self.x[:n], self.x[n:]
        q0 = self.qkv(x0, 0)
        for layer in range(LAYERS):
            a0 = self.attend(q0, layer, "h0")  # main: attention of half 0 ...
            with torch.cuda.stream(side):  # ... beside the GEMMs that bring half 1 to this layer
                q1 = self.qkv(x1, layer)
            main.wait_stream(side)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                a1 = self.attend(q1, layer, "h1")  # side: attention of half 1 ...
            x0 = self.mlp(a0, x0, layer)  # ... beside half 0's MLP and next qkv
            if layer + 1 < LAYERS:
                q0 = self.qkv(x0, layer + 1)
            main.wait_stream(side)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                x1 = self.mlp(a1, x1, layer)
            # half 1's MLP overlaps half 0's next attention: no join until the next layer's pairing
        main.wait_stream(side)
        self.out[:n].copy_(x0)
        self.out[n:].copy_(x1)

    def gemms(self):
        x = self.x
        for layer in range(LAYERS):
            qkv = self.qkv(x, layer)
            x = self.mlp(qkv[:, : HQ * D], x, layer)
        self.out.copy_(x)

    def attention(self):
        qkv = torch.zeros(B, HQ * D + 2 * HKV * D, device=DEV, dtype=DT)
        for layer in range(LAYERS):
            self.attend(qkv, layer, "all")


def graph_ms(fn, replays: int = 10) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def main() -> None:
    step = Step()
    step.side = torch.cuda.Stream()
    kv_gb = 2 * B * CTX * HKV * D * 2 * LAYERS / 1e9
    flop = 2 * B * LAYERS * (step.wqkv[0].numel() + step.wo[0].numel() + step.wgu[0].numel() + step.wd[0].numel())
    results: dict = {"B": B, "CTX": CTX, "LAYERS": LAYERS, "kv_gb": round(kv_gb, 2), "gemm_tflop": round(flop / 1e12, 3)}
    step.full()
    torch.cuda.synchronize()
    ref = step.out.float().clone()
    has_carveout = hasattr(torch._C, "_set_sm_carveout_experimental")
    variants = [("full", step.full, 0), ("gemms", step.gemms, 0), ("attention", step.attention, 0),
                ("halves_serial", step.halves_serial, 0)]  # fmt: skip
    for c in CARVEOUTS if has_carveout else (0,):
        variants += [(f"halves_streams_c{c}", step.halves_streams, c), (f"paired_c{c}", step.paired, c)]
    for name, fn, carveout in variants:
        if has_carveout:
            torch._C._set_sm_carveout_experimental(carveout or None)
        try:
            ms = graph_ms(fn)
            err = None
            if name not in ("gemms", "attention"):
                err = float((step.out.float() - ref).abs().max() / ref.abs().max())
            row = {"ms": round(ms, 3), "rel_err": err}
            if name == "gemms":
                row["tflops"] = round(flop / ms / 1e9, 1)
            if name == "attention":
                row["tb_s"] = round(kv_gb / ms, 2)
        except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, the rest go on
            row = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        results[name] = row
        print(f"RESULT overlap {name}: {row}", flush=True)
    if has_carveout:
        torch._C._set_sm_carveout_experimental(None)
    (OUT / "overlap_micro.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
