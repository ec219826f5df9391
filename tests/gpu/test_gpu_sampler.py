"""The sampler's GPU paths against their references (were scripts/gpu/sampler_check.py and
sampling_kernels_check.py), at 512 rows x 128,256 as a decode step of the 8B shape samples:
- the two-stage argmax equals torch.argmax, ties included;
- the penalties kernel equals `PenaltyState.apply_tensors` bit for bit;
- the race kernel given torch's noise picks `exponential_race`'s tokens, and with its own noise draws
  each token at its softmax frequency;
- the filtered race (top-p, min-p) given torch's noise picks the reference's sort-and-race tokens, on
  peaked and flat logits, seeded rows hashed in the kernel too, and draws at the nucleus' frequencies.
"""

from __future__ import annotations

import pytest
import torch
from gpu_utils import free_device_memory  # noqa: F401

from llmserve.engine import seeded_noise
from llmserve.engine.argmax import row_argmax
from llmserve.engine.penalty_state import PenaltyState
from llmserve.engine.request import EngineCoreRequest, Request
from llmserve.engine.sampler_reference import apply_top_k_top_p_min_p, exponential_race
from llmserve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

VOCAB = 128256
ROWS = 512
DRAWS = 200_000


def requests(kind: dict, rows: int, outputs: int = 200) -> list[Request]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(rows):
        prompt = torch.randint(0, VOCAB, (512,), generator=gen).tolist()
        req = Request(EngineCoreRequest(f"r{i}", prompt, SamplingParams(max_tokens=256, **kind), 256, (2,)))
        req.all_token_ids.extend(torch.randint(0, VOCAB, (outputs,), generator=gen).tolist())
        out.append(req)
    return out


@pytest.mark.parametrize("rows", [1, 4, 16, 64, 512, 1000])
def test_row_argmax_equals_torch_argmax(rows):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, VOCAB, device="cuda", generator=g)
    x[0, 1000] = x[0, 90000] = 50.0  # a tie across chunks
    if rows > 1:
        x[1, :] = 0.0  # all equal
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))


def test_penalties_kernel_equals_the_tensor_ops():
    kinds = [dict(repetition_penalty=1.1), dict(presence_penalty=0.5), dict(frequency_penalty=0.3, presence_penalty=0.2),
             dict(repetition_penalty=0.9, frequency_penalty=0.1)]  # fmt: skip
    reqs = [r for k in kinds for r in requests(k, ROWS // 4)]
    for i, r in enumerate(reqs):
        r.request_id = f"p{i}"
    state = PenaltyState(VOCAB, torch.device("cuda"), use_kernel=True)
    pen = state.rows_for(reqs)
    logits = torch.randn(len(reqs), VOCAB, device="cuda") * 3
    want = state.apply_tensors(logits.clone(), pen)
    got = state.apply(logits.clone(), pen)
    assert int((want != logits).sum()) > 0
    assert torch.equal(got, want)


def test_race_kernel_picks_the_reference_tokens_and_draws_at_softmax_frequencies():
    from llmserve.kernels.sampling import race

    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(ROWS, VOCAB, device="cuda", generator=gen) * 3
    temperature = torch.full((ROWS,), 0.8, device="cuda")
    noise = torch.empty_like(logits).exponential_(generator=gen)
    assert torch.equal(
        race(logits, None, temperature, noise=noise), exponential_race(logits / temperature[:, None], noise)
    )
    row = torch.tensor([1.0, 2.0, 0.5, float("-inf"), 0.0, 1.5, -1.0, 2.5], device="cuda")
    tokens = race(row.repeat(DRAWS, 1), None, torch.full((DRAWS,), 0.8, device="cuda"))
    freq = torch.bincount(tokens, minlength=8).double() / DRAWS
    probs = torch.softmax(row.double() / 0.8, dim=-1)
    assert freq[3].item() == 0.0  # the -inf token
    assert (freq - probs).abs().max().item() < 0.005  # a frequency's standard deviation over DRAWS draws: about 0.001


@pytest.mark.parametrize("scale", [3.0, 0.3], ids=["peaked", "flat"])
def test_filtered_race_picks_the_reference_tokens(scale):
    from llmserve.kernels.filtered_race import filtered_race

    gen = torch.Generator(device="cuda").manual_seed(2)
    temperature = torch.full((ROWS,), 0.8, device="cuda")
    top_p = torch.tensor([0.95, 0.5, 0.05, 1.0] * (ROWS // 4), device="cuda")
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.05] * (ROWS // 4), device="cuda")

    def reference(logits, noise):
        part = apply_top_k_top_p_min_p(logits / temperature[:, None], [0] * ROWS, top_p.tolist(), min_p.tolist())
        return exponential_race(part, noise)

    logits = torch.randn(ROWS, VOCAB, device="cuda", generator=gen) * scale
    noise = torch.empty_like(logits).exponential_(generator=gen)
    assert torch.equal(filtered_race(logits, None, temperature, top_p, min_p, noise=noise), reference(logits, noise))
    keys = torch.tensor([seeded_noise.row_key(i * 7919, i) for i in range(ROWS)], device="cuda")
    slots = torch.arange(ROWS, dtype=torch.int32, device="cuda")
    seeded_want = reference(logits, seeded_noise.exponential(keys, torch.arange(VOCAB, device="cuda")))
    assert torch.equal(filtered_race(logits, None, temperature, top_p, min_p, slots, keys), seeded_want)


def test_filtered_race_draws_at_the_nucleus_frequencies():
    from llmserve.kernels.filtered_race import filtered_race

    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf"), 1.5, -0.5], device="cuda")
    tokens = filtered_race(row.repeat(DRAWS, 1), None, None, torch.full((DRAWS,), 0.8, device="cuda"),
                           torch.zeros(DRAWS, device="cuda"))  # fmt: skip
    freq = torch.bincount(tokens, minlength=8).double() / DRAWS
    kept = torch.isfinite(apply_top_k_top_p_min_p(row[None].double(), [0], [0.8], [0.0])[0])
    nucleus = torch.where(kept, torch.softmax(row.double(), dim=-1), 0.0)
    nucleus = nucleus / nucleus.sum()
    assert (freq - nucleus).abs().max().item() < 0.005  # a frequency's standard deviation over DRAWS draws: about 0.001
