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
    from llmserve.bench import latency, throughput
    from llmserve.cli_args import engine_args_from_cli
    from llmserve.heap import frozen

    make_model_folder()
    started = time.perf_counter()
    llm = LLM(**vars(engine_args_from_cli(bench_args("throughput", ENGINES["short"]))))
    print(f"RESULT old engine ready in {time.perf_counter() - started:.1f} s", flush=True)
    args = bench_args("throughput", ROWS["a_t1"][2])
    prompts, out_lens = throughput.make_prompts(args.num_prompts, args.input_len, args.output_len, 0.0,
                                                llm.config.model_config.arch.vocab_size, args.bench_seed)  # fmt: skip
    params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    with frozen("old bench"):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT old a_t1", json.dumps({"output_tokens_per_s": round(tokens / elapsed, 1)}), flush=True)
    args = bench_args("throughput", ROWS["c"][2])
    prompts, out_lens = throughput.make_prompts(args.num_prompts, args.input_len, args.output_len, 0.0,
                                                llm.config.model_config.arch.vocab_size, args.bench_seed)  # fmt: skip
    params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    with frozen("old bench c"):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT old c", json.dumps({"output_tokens_per_s": round(tokens / elapsed, 1)}), flush=True)
    largs = bench_args("latency", ROWS["b"][2])
    with frozen("old bench latency"):
        r = latency._measure(largs, llm, [50, 90, 99])
    print("RESULT old b", json.dumps({"ttft_ms": r["ttft_ms"], "tpot_ms": r["tpot_ms"]}), flush=True)


if __name__ == "__main__":
    main()
