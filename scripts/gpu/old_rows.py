"""Workloads (a) at temperature 1.0, (c) and (b) on an earlier llmserve, for a before/after in one
lease: `python3 scripts/gpu/old_rows.py --root DIR` imports llmserve from DIR (e.g. a
`git archive <commit> llmserve` unpacked there) and times both on one engine with the same
flags as scripts/gpu/bench_rows.py's engine "short" (the earlier code's own bench modules do
the timing: its `make_prompts`, `frozen` and latency `_measure`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    opts = ap.parse_args()
    sys.path.insert(0, opts.root)
    import llmserve

    assert llmserve.__file__.startswith(opts.root), llmserve.__file__
    from bench_rows import ENGINES, ROWS, bench_args, make_model_folder  # this folder's (the flags only)

    from llmserve import LLM, SamplingParams
    from llmserve.bench import latency
    from llmserve.bench import throughput as throughput_module
    from llmserve.cli_args import engine_args_from_cli
    from llmserve.heap import frozen

    make_model_folder()
    started = time.perf_counter()
    llm = LLM(**vars(engine_args_from_cli(bench_args("throughput", ENGINES["short"]))))
    print(f"RESULT old engine ready in {time.perf_counter() - started:.1f} s", flush=True)
    def throughput(row: str) -> float:
        """The row's prompts at temperature 1, timed as the earlier `bench throughput` timed them."""
        args = bench_args("throughput", ROWS[row][2])
        prompts, out_lens = throughput_module.make_prompts(args.num_prompts, args.input_len, args.output_len, 0.0,
                                                           llm.config.model_config.arch.vocab_size, args.bench_seed)  # fmt: skip
        params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in out_lens]
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        with frozen(f"old bench {row}"):
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
        return round(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, 1)

    for row in ("a_t1", "c"):
        print(f"RESULT old {row}", json.dumps({"output_tokens_per_s": throughput(row)}), flush=True)
    largs = bench_args("latency", ROWS["b"][2])
    with frozen("old bench latency"):
        r = latency._measure(largs, llm, [50, 90, 99])
    print("RESULT old b", json.dumps({"ttft_ms": r["ttft_ms"], "tpot_ms": r["tpot_ms"]}), flush=True)


if __name__ == "__main__":
    main()
