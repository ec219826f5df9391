"""The KV memory a long sequence holds on Gemma 3 270M (five sliding-window layers of 512 keys to
each global one), measured on the engine: after every step of one request, the bytes of the
blocks its KV groups hold (engine/kv_layout.py), beside what a plain paged cache (every layer
keeps every block) would hold. Writes a table (markdown) and a plot (PNG).

    .venv/bin/python scripts/docs/sliding_window_memory.py --tokens 4096 --out docs/sliding_window_memory
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llmserve import LLM, SamplingParams
from llmserve.engine.kv_layout import NULL_BLOCK
from llmserve.model.gguf.split_parts import GEMMA3_270M, assemble


def measure(tokens: int, chunk: int, output: int) -> dict:
    llm = LLM(str(assemble(GEMMA3_270M)), max_model_len=tokens + output, enable_chunked_prefill=True,
              max_num_batched_tokens=chunk, enable_prefix_caching=False)  # fmt: skip
    kv, runner = llm.core.kv, llm.core.runner
    block_bytes, bs, groups = runner.bytes_per_block, kv.block_size, kv.groups
    layer_block_bytes = block_bytes // kv.layout.layers_per_group  # one layer's block
    num_layers = len(kv.layout.layer_group)
    rows = []
    original = kv.allocate_slots

    def watch(req, num_new, *args, **kwargs):
        ok = original(req, num_new, *args, **kwargs)
        if ok:
            blocks = kv.block_table(req.request_id)
            held = sum(b != NULL_BLOCK for b in blocks)
            end = req.num_computed_tokens + num_new
            rows.append({"tokens": end, "held_bytes": held * block_bytes,
                         "plain_bytes": -(-end // bs) * num_layers * layer_block_bytes})  # fmt: skip
        return ok

    kv.allocate_slots = watch
    prompt = [2] + [(37 * i) % 20000 + 100 for i in range(tokens - 1)]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    return {"layout": str(kv.layout), "block_size": bs, "groups": groups, "chunk": chunk, "rows": rows,
            "kv_dtype": str(runner.kv_dtype)}  # fmt: skip


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    x = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [r["plain_bytes"] / 2**20 for r in rows], label="plain paged cache (every layer, every block)")
    ax.plot(x, [r["held_bytes"] / 2**20 for r in rows], label="llmserve KV groups (sliding layers hold their window)")
    ax.set_xlabel("tokens in the sequence")
    ax.set_ylabel("KV cache held by the sequence, MiB")
    ax.set_title("Gemma 3 270M, one sequence (window 512 on 15 of 18 layers)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--out", default="docs/sliding_window_memory")
    args = parser.parse_args()
    result = measure(args.tokens, args.chunk, args.output_tokens)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"{result['layout']}; block size {result['block_size']}, {result['kv_dtype']}, chunks of {args.chunk}")
    print("| tokens | plain cache, MiB | llmserve, MiB | saved |")
    print("| ---: | ---: | ---: | ---: |")
    marks = sorted({min(result["rows"], key=lambda r, t=t: abs(r["tokens"] - t))["tokens"]
                    for t in (512, 1024, 2048, args.tokens + args.output_tokens)})  # fmt: skip
    for row in result["rows"]:
        if row["tokens"] in marks:
            marks.remove(row["tokens"])
            plain, held = row["plain_bytes"] / 2**20, row["held_bytes"] / 2**20
            print(f"| {row['tokens']:,} | {plain:.1f} | {held:.1f} | {1 - held / plain:.0%} |")


if __name__ == "__main__":
    main()
