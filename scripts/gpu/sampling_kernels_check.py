"""The sampler's kernels on the GPU (llmserve/kernels/sampling.py), against their references,
and what a decode step's sampling costs with and without them. Run on the device machine:

    python3 scripts/gpu/sampling_kernels_check.py

1. Penalties: the kernel against `PenaltyState.apply_tensors` on 512 rows x 128,256 (repetition,
   presence and frequency; counts and prompts filled): the largest difference (must be 0).
2. The race: the kernel given torch's Exp(1) noise against `exponential_race(logits / T, E)` (tokens
   equal); with its own noise, how often each of 8 tokens wins over 200,000 rows against softmax.
3. The filtered race (llmserve/kernels/filtered_race.py): given torch's noise, against the
   reference's sort and race (tokens equal), at top-p 0.95 / 0.5 / 0.05 and min-p, on peaked
   (randn x 3) and flat (randn x 0.3) logits; seeded rows hashed in the kernel against
   `seeded_noise.exponential`; a row's frequencies against its nucleus; its time against the sort's.
4. The batched sampler's GPU time a step (CUDA events, median of 20), `use_kernels` off and on:
   greedy, temperature 0.8, top-k/top-p, top-p alone (and seeded), the OpenAI mix, min-p,
   presence 0.5 at T 0.8, repetition 1.1 greedy, logprobs 5, at 512 rows.
`--only penalties,race,filtered,sampler_ms` picks parts. Prints RESULT lines; writes
$OUT/sampling_kernels_check.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from event_timer import median_ms  # noqa: E402

from llmserve.engine.penalty_state import PenaltyState  # noqa: E402
from llmserve.engine.request import EngineCoreRequest, Request  # noqa: E402
from llmserve.engine.sampler import Sampler  # noqa: E402
from llmserve.engine.sampler_reference import exponential_race  # noqa: E402
from llmserve.kernels.sampling import race  # noqa: E402
from llmserve.sampling_params import SamplingParams  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
VOCAB = 128256
ROWS = 512
DEV = torch.device("cuda")


def requests(kind: dict, rows: int | None = None, outputs: int = 200) -> list[Request]:
    rows = ROWS if rows is None else rows
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(rows):
        prompt = torch.randint(0, VOCAB, (512,), generator=gen).tolist()
        req = Request(EngineCoreRequest(f"r{i}", prompt, SamplingParams(max_tokens=256, **kind), 256, (2,)))
        req.all_token_ids.extend(torch.randint(0, VOCAB, (outputs,), generator=gen).tolist())
        out.append(req)
    return out


def check_penalties() -> dict:
    kinds = [dict(repetition_penalty=1.1), dict(presence_penalty=0.5), dict(frequency_penalty=0.3, presence_penalty=0.2),
             dict(repetition_penalty=0.9, frequency_penalty=0.1)]  # fmt: skip
    reqs = [r for k in kinds for r in requests(k, ROWS // 4)]
    for i, r in enumerate(reqs):
        r.request_id = f"p{i}"
    state = PenaltyState(VOCAB, DEV, use_kernel=True)
    pen = state.rows_for(reqs)
    logits = torch.randn(len(reqs), VOCAB, device=DEV) * 3
    want = state.apply_tensors(logits.clone(), pen)
    got = state.apply(logits.clone(), pen)
    x = logits.clone()
    return {"max_abs_diff": (got - want).abs().max().item(), "changed": int((want != logits).sum().item()),
            "kernel_ms": round(median_ms(lambda: state.apply(x, pen), iters=20, warmup=3), 3),
            "tensor_ops_ms": round(median_ms(lambda: state.apply_tensors(x, pen), iters=20, warmup=3), 3)}  # fmt: skip


def check_race() -> dict:
    gen = torch.Generator(device=DEV).manual_seed(1)
    logits = torch.randn(ROWS, VOCAB, device=DEV, generator=gen) * 3
    temperature = torch.full((ROWS,), 0.8, device=DEV)
    noise = torch.empty_like(logits).exponential_(generator=gen)
    want = exponential_race(logits / temperature[:, None], noise)
    got = race(logits, None, temperature, noise=noise)
    row = torch.tensor([1.0, 2.0, 0.5, float("-inf"), 0.0, 1.5, -1.0, 2.5], device=DEV)
    n = 200_000
    tokens = race(row.repeat(n, 1), None, torch.full((n,), 0.8, device=DEV))
    freq = torch.bincount(tokens, minlength=8).double() / n
    probs = torch.softmax(row.double() / 0.8, dim=-1)

    def torch_path():
        part = logits / temperature[:, None]
        return exponential_race(part, torch.empty_like(part).exponential_())

    return {"tokens_equal": int((got == want).sum().item()), "rows": ROWS,
            "freq": [round(f, 4) for f in freq.tolist()], "softmax": [round(p, 4) for p in probs.tolist()],
            "max_freq_error": round((freq - probs).abs().max().item(), 5),
            "kernel_ms": round(median_ms(lambda: race(logits, None, temperature), iters=20, warmup=3), 3),
            "tensor_ops_ms": round(median_ms(torch_path, iters=20, warmup=3), 3)}  # fmt: skip


def check_filtered() -> dict:
    from llmserve.engine import seeded_noise
    from llmserve.engine.sampler_reference import apply_top_k_top_p_min_p
    from llmserve.kernels.filtered_race import filtered_race

    gen = torch.Generator(device=DEV).manual_seed(2)
    temperature = torch.full((ROWS,), 0.8, device=DEV)
    top_p = torch.tensor([0.95, 0.5, 0.05, 1.0] * (ROWS // 4), device=DEV)
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.05] * (ROWS // 4), device=DEV)

    def reference(logits, noise):
        part = apply_top_k_top_p_min_p(logits / temperature[:, None], [0] * ROWS, top_p.tolist(), min_p.tolist())
        return exponential_race(part, noise)

    out = {}
    for name, scale in (("peaked", 3.0), ("flat", 0.3)):
        logits = torch.randn(ROWS, VOCAB, device=DEV, generator=gen) * scale
        noise = torch.empty_like(logits).exponential_(generator=gen)
        want = reference(logits, noise)
        got = filtered_race(logits, None, temperature, top_p, min_p, noise=noise)
        keys = torch.tensor([seeded_noise.row_key(i * 7919, i) for i in range(ROWS)], device=DEV)
        slots = torch.arange(ROWS, dtype=torch.int32, device=DEV)
        seeded_want = reference(logits, seeded_noise.exponential(keys, torch.arange(VOCAB, device=DEV)))
        seeded_got = filtered_race(logits, None, temperature, top_p, min_p, slots, keys)
        p95 = torch.full((ROWS,), 0.95, device=DEV)
        zeros = torch.zeros(ROWS, device=DEV)
        out[name] = {
            "tokens_equal": int((got == want).sum().item()), "seeded_tokens_equal": int((seeded_got == seeded_want).sum().item()),
            "rows": ROWS,
            "kernel_mixed_ms": round(median_ms(lambda: filtered_race(logits, None, temperature, top_p, min_p), iters=20, warmup=3), 3),
            "kernel_topp095_ms": round(median_ms(lambda: filtered_race(logits, None, temperature, p95, zeros), iters=20, warmup=3), 3),
            "kernel_seeded_ms": round(median_ms(lambda: filtered_race(logits, None, temperature, top_p, min_p, slots, keys), iters=20, warmup=3), 3),
            "sort_ms": round(median_ms(lambda: reference(logits, torch.empty_like(logits).exponential_()), iters=10, warmup=2), 3),
        }  # fmt: skip
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf"), 1.5, -0.5], device=DEV)
    n = 200_000
    tokens = filtered_race(row.repeat(n, 1), None, None, torch.full((n,), 0.8, device=DEV), torch.zeros(n, device=DEV))
    freq = torch.bincount(tokens, minlength=8).double() / n
    kept = torch.isfinite(apply_top_k_top_p_min_p(row[None].double(), [0], [0.8], [0.0])[0])
    nucleus = torch.where(kept, torch.softmax(row.double(), dim=-1), 0.0)
    nucleus = nucleus / nucleus.sum()
    out["freq"] = [round(f, 4) for f in freq.tolist()]
    out["nucleus"] = [round(p, 4) for p in nucleus.tolist()]
    out["max_freq_error"] = round((freq - nucleus).abs().max().item(), 5)
    return out


def sampler_ms() -> dict:
    kinds = {"greedy": dict(temperature=0.0), "t0.8": dict(temperature=0.8),
             "topk50_topp": dict(temperature=0.8, top_k=50, top_p=0.95),
             "topp": dict(temperature=0.8, top_p=0.95), "topp_seeded": dict(temperature=0.8, top_p=0.95, seed=7),
             "openai": dict(temperature=0.7, top_p=0.9, presence_penalty=0.3, frequency_penalty=0.3),
             "minp": dict(temperature=0.8, min_p=0.05), "logprobs5": dict(temperature=0.0, logprobs=5),
             "presence": dict(temperature=0.8, presence_penalty=0.5),
             "repetition": dict(temperature=0.0, repetition_penalty=1.1)}  # fmt: skip
    logits = torch.randn(ROWS, VOCAB, device=DEV, dtype=torch.bfloat16)
    out = {}
    for name, kw in kinds.items():
        reqs = requests(kw)
        for kernels in (False, True):
            sampler = Sampler(DEV, use_kernels=kernels)
            out[f"{name}@{ROWS}{' kernels' if kernels else ''}"] = round(
                median_ms(lambda: sampler.sample_async(logits, reqs), iters=20, warmup=5), 3
            )
    return out


def main() -> None:
    parts = {"penalties": check_penalties, "race": check_race, "filtered": check_filtered, "sampler_ms": sampler_ms}
    only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else list(parts)
    result = {name: parts[name]() for name in only}
    (OUT / "sampling_kernels_check.json").write_text(json.dumps(result, indent=1))
    for key, value in result.items():
        print("RESULT", key, json.dumps(value), flush=True)


if __name__ == "__main__":
    main()
