"""The mixture-of-experts families (issue 52): Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral give
transformers' greedy tokens (float32, CPU) on tiny random folders, on the PyTorch reference path and
on the fused Triton kernels under the interpreter; their checkpoints load per expert and stacked;
bad checkpoints and refused features are errors that name what is wrong."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from conftest import assert_no_leak, hf_greedy
from safetensors.torch import load_file, save_file

from llmserve import LLM, SamplingParams
from llmserve.config import ConfigError, EngineArgs
from llmserve.model.arch import UnsupportedModelError, parse_model_arch
from llmserve.model.random_model import make_random_model
from llmserve.model.registry import family_for_config

pytestmark = pytest.mark.unit

MAX_NEW = 16
# family -> what its test folder adds to random_model's small MoE shape
FOLDERS = {
    "qwen3_moe": dict(num_hidden_layers=3, mlp_only_layers=[1]),  # a dense layer between two sparse ones
    "qwen2_moe": dict(rope_theta=1000000.0),
    "mixtral": dict(sliding_window=32),  # every layer windowed: prompts and outputs cross it
}


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 500) for _ in range(n - 1)] for n in (1, 6, 23, 45)]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    return {family: str(make_random_model(root / family, family, seed=i + 10, **FOLDERS[family]))
            for i, family in enumerate(FOLDERS)}  # fmt: skip


@pytest.fixture(scope="module")
def references(moe_dirs) -> dict[str, list[list[int]]]:
    return {family: hf_greedy(path, _prompts(i), MAX_NEW) for i, (family, path) in enumerate(moe_dirs.items())}


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_NEW) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0,
                        max_tokens=max_tokens), use_tqdm=False)  # fmt: skip
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", list(FOLDERS))
def test_greedy_matches_transformers(moe_dirs, references, family):
    """Prefix caching on and prefill chunked in 16s (a prompt's chunks meet decodes in a step)."""
    llm = LLM(moe_dirs[family], max_model_len=96, enable_prefix_caching=True, enable_chunked_prefill=True,
              max_num_batched_tokens=16)  # fmt: skip
    assert _generate(llm, _prompts(list(FOLDERS).index(family))) == references[family]
    assert_no_leak(llm)


def test_the_fused_kernels_in_the_engine_give_transformers_tokens(moe_dirs, monkeypatch):
    """The Triton path (attention_backend triton) under the interpreter: the MoE layers run
    kernels/fused_moe.py, and Qwen2-MoE's tokens (shared expert, renormalisation off) equal transformers'."""
    from llmserve.kernels import fused_moe as fm

    calls = []
    fused = fm.fused_moe
    monkeypatch.setattr(fm, "fused_moe", lambda *a, **kw: calls.append(a[0].shape[0]) or fused(*a, **kw))
    prompts = _prompts(5)[1:3]
    want = hf_greedy(moe_dirs["qwen2_moe"], prompts, 4)
    llm = LLM(moe_dirs["qwen2_moe"], attention_backend="triton", max_model_len=64, block_size=8)
    assert _generate(llm, prompts, 4) == want
    assert calls and max(calls) > 1  # prefill rows and decode rows both went through it


def _rewrite(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    save_file(edit(tensors), str(path), metadata={"format": "pt"})


def test_stacked_expert_tensors_load_as_per_expert_ones(moe_dirs, references, tmp_path):
    """transformers' in-memory names (`mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`)
    give the same model as the per-expert tensors `save_pretrained` writes (Mixtral's w1/w2/w3 too)."""
    import shutil

    folder = Path(shutil.copytree(moe_dirs["mixtral"], tmp_path / "stacked"))

    def stack(tensors):
        out = {k: v for k, v in tensors.items() if ".experts." not in k}
        for layer in range(2):
            p = f"model.layers.{layer}.block_sparse_moe.experts"
            gate_up = [torch.cat([tensors[f"{p}.{e}.w1.weight"], tensors[f"{p}.{e}.w3.weight"]]) for e in range(8)]
            out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
            out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([tensors[f"{p}.{e}.w2.weight"]
                                                                              for e in range(8)])  # fmt: skip
        return out

    _rewrite(folder, stack)
    llm = LLM(str(folder), max_model_len=96)
    assert _generate(llm, _prompts(2)) == references["mixtral"]


def test_a_checkpoint_that_disagrees_with_its_config_is_refused(moe_dirs, tmp_path):
    import shutil

    bad = Path(shutil.copytree(moe_dirs["qwen3_moe"], tmp_path / "shape"))
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    _rewrite(bad, lambda t: {**t, name: t[name][:16]})  # 16 rows where the config says 32
    with pytest.raises(ValueError, match=rf"{name}.*shape \(16, 64\).*\(32, 64\)"):
        LLM(str(bad), max_model_len=64)
    fewer = Path(shutil.copytree(moe_dirs["qwen3_moe"], tmp_path / "experts"))
    config = json.loads((fewer / "config.json").read_text())
    (fewer / "config.json").write_text(json.dumps({**config, "num_experts": 6}))  # the checkpoint holds 8
    with pytest.raises(KeyError, match=r"model.layers.0.mlp.experts.6.\w+.weight.*expert 6.*6 experts"):
        LLM(str(fewer), max_model_len=64)
    missing = Path(shutil.copytree(moe_dirs["qwen3_moe"], tmp_path / "missing"))
    _rewrite(missing, lambda t: {k: v for k, v in t.items() if k != "model.layers.0.mlp.experts.3.down_proj.weight"})
    with pytest.raises(ValueError, match=r"lacks.*model.layers.0.mlp.experts.down_proj#3"):
        LLM(str(missing), max_model_len=64)


def test_configs_parse_into_experts_and_dense_layers():
    base = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    q3 = parse_model_arch({**base, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128,
                           "num_experts_per_tok": 8, "moe_intermediate_size": 32, "norm_topk_prob": True,
                           "decoder_sparse_step": 2, "mlp_only_layers": [3]})  # fmt: skip
    assert (q3.num_experts, q3.top_k, q3.norm_topk_prob, q3.qk_norm) == (128, 8, True, True)
    assert q3.sparse_layers == (False, True, False, False)  # every second layer, but layer 3 is dense
    q2 = parse_model_arch({**base, "model_type": "qwen2_moe", "num_experts": 8, "num_experts_per_tok": 2,
                           "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48})  # fmt: skip
    assert q2.shared_expert_intermediate_size == 48 and q2.attention_bias and not q2.norm_topk_prob
    mx = parse_model_arch({**base, "architectures": ["MixtralForCausalLM"], "sliding_window": 4096})
    assert (mx.num_experts, mx.top_k, mx.moe_intermediate_size, mx.layer_window(0)) == (8, 2, 96, 4096)
    assert family_for_config({"architectures": ["MixtralForCausalLM"]}).name == "Mixtral"
    with pytest.raises(UnsupportedModelError, match="9 experts per token"):
        parse_model_arch({**base, "architectures": ["MixtralForCausalLM"], "num_experts_per_tok": 9})


@pytest.mark.parametrize(
    "option, message",
    [
        (dict(enable_lora=True), "Qwen3-MoE models do not support lora"),
        (dict(tensor_parallel_size=3), r"num_attention_heads \(4\) is not divisible by tensor_parallel_size 3"),
        (dict(tensor_parallel_size=2, moe_intermediate_size=33), r"moe_intermediate_size \(33\) is not divisible"),
        (dict(tensor_parallel_size=4, enable_expert_parallel=True, num_experts=6),
         r"num_experts \(6\) is not divisible by tensor_parallel_size 4 with --enable-expert-parallel"),
    ],
)  # fmt: skip
def test_refused_features_are_errors_at_start(tmp_path, option, message):
    shape = {k: option.pop(k) for k in ("moe_intermediate_size", "num_experts") if k in option}
    folder = make_random_model(tmp_path / "q3", "qwen3_moe", config_only=True, num_attention_heads=4,
                               num_key_value_heads=4, **shape)  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        EngineArgs(model=str(folder), load_format="dummy", **option).create_engine_config()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_make_random_model_shapes_serve_dummy_weights(tmp_path, family):
    """`llmserve make-random-model --config-only` with the MoE flags gives a folder whose config
    parses into those experts and serves with dummy weights."""
    from llmserve.cli import main

    out = tmp_path / family
    main(["make-random-model", str(out), "--family", family, "--config-only", "--num-experts", "16",
          "--num-experts-per-tok", "4", "--moe-intermediate-size", "48"])  # fmt: skip
    llm = LLM(str(out), load_format="dummy", max_model_len=64)
    arch = llm.config.model_config.arch
    assert (arch.num_experts, arch.top_k, arch.moe_intermediate_size) == (16, 4, 48)
    assert len(_generate(llm, [[1, 5, 9]], 4)[0]) == 4


def test_families_declare_their_experts_and_bench_counts_the_active_ones():
    """`ModelFamily.experts`: each layer's ExpertSpec (None: dense), and the dense layers' MLPs as
    LinearSpecs of those layers only; `bench latency`'s weight bytes read top_k experts a token (the
    Qwen3-30B-A3B shape: about 3.3 B active parameters, ~6.7 GB in bf16), every expert for a large batch."""
    from llmserve.bench.latency import weight_bytes_per_step
    from llmserve.model.fp8 import projection_names
    from llmserve.model.interface import is_moe
    from llmserve.model.registry import family_of

    base = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128}  # fmt: skip
    arch = parse_model_arch({**base, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128,
                             "num_experts_per_tok": 8, "moe_intermediate_size": 768})  # fmt: skip
    specs = family_of(arch).experts(arch)
    assert len(specs) == 48 and all(s is not None for s in specs) and is_moe(arch)
    spec = specs[0]
    assert (spec.num_experts, spec.top_k, spec.intermediate, spec.shared_intermediate) == (128, 8, 768, 0)
    one = weight_bytes_per_step(arch, torch.bfloat16)
    assert 6.0e9 < one < 6.9e9, one  # attention, router, 8 of 128 experts, the LM head
    assert weight_bytes_per_step(arch, torch.bfloat16, batch_size=4096) > 8 * one  # nearly every expert
    assert weight_bytes_per_step(arch, torch.bfloat16, "fp8") < one
    mixed = parse_model_arch({**base, "num_hidden_layers": 4, "architectures": ["Qwen3MoeForCausalLM"],
                              "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                              "mlp_only_layers": [1]})  # fmt: skip
    assert [s is None for s in family_of(mixed).experts(mixed)] == [False, True, False, False]
    names = projection_names(mixed)
    assert "model.layers.1.mlp.down_proj" in names and "model.layers.0.mlp.down_proj" not in names
    assert not is_moe(parse_model_arch({**base, "architectures": ["Qwen3ForCausalLM"]}))


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_each_rank_loads_its_share_per_expert_and_stacked(moe_dirs, expert_parallel):
    """Under TP=2 a rank holds every expert's half (gate and up rows, down columns) and the shared
    expert's; under EP=2 half the experts whole. The per-expert and the stacked tensors give a rank
    the same parameters, and the ranks' shares put together are the whole checkpoint's."""
    from llmserve.model.attention import reference_paged_attention
    from llmserve.model.loader import load_model
    from llmserve.model.tensor_parallel import TPGroup

    folder = moe_dirs["qwen2_moe"]
    arch = parse_model_arch(json.loads((Path(folder) / "config.json").read_text()))
    tensors = load_file(str(Path(folder) / "model.safetensors"))
    p = "model.layers.0.mlp.experts"
    gate_up = torch.stack([torch.cat([tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"]])
                           for e in range(8)])  # fmt: skip
    down = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(8)])
    shares = []
    for rank in (0, 1):
        tp = TPGroup(rank, 2, None, expert_parallel)
        model = load_model(folder, arch, torch.float32, "cpu", reference_paged_attention, progress=False, tp=tp)
        experts = model.model.layers[0].mlp.experts
        shares.append((experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()))
        stacked = {f"{p}.gate_up_proj": gate_up, f"{p}.down_proj": down}
        loaded = model.load_weights(stacked.items())
        assert loaded == {k for k in model.expected_weight_keys() if k.startswith(p)}
        assert torch.equal(experts.gate_up_proj, shares[-1][0]) and torch.equal(experts.down_proj, shares[-1][1])
    (gu0, d0), (gu1, d1) = shares
    if expert_parallel:
        assert gu0.shape == (4, 64, 64) and torch.equal(torch.cat([gu0, gu1]), gate_up)
        assert torch.equal(torch.cat([d0, d1]), down)
    else:
        assert gu0.shape == (8, 32, 64)
        whole = torch.cat([gu0[:, :16], gu1[:, :16], gu0[:, 16:], gu1[:, 16:]], dim=1)  # gate halves, up halves
        assert torch.equal(whole, gate_up) and torch.equal(torch.cat([d0, d1], dim=2), down)


def test_fp8_experts_stay_close_to_the_16_bit_model(moe_dirs):
    """`--quantization fp8` on a MoE: the experts (and the attention and dense projections) in FP8 E4M3
    with a scale per output channel, tokens quantized per token; the PyTorch reference runs them. The
    first tokens equal the float32 model's and the first logprobs stay within FP8's rounding."""
    prompts = [{"prompt_token_ids": p} for p in _prompts(4)[1:]]
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=5)
    outs = {}
    for quantization in (None, "fp8"):
        with LLM(moe_dirs["qwen2_moe"], quantization=quantization, max_model_len=96) as llm:
            outs[quantization] = llm.generate(prompts, params, use_tqdm=False)
            if quantization:
                experts = llm.core.runner.model.model.layers[0].mlp.experts
                assert experts.gate_up_proj.dtype == torch.float8_e4m3fn
                assert experts.down_proj_scale.dtype == torch.float32
    for a, b in zip(outs[None], outs["fp8"]):
        assert a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        for token in first_a.keys() & first_b.keys():
            assert first_a[token].logprob == pytest.approx(first_b[token].logprob, abs=0.1)


def test_expert_parallel_on_a_dense_model_is_refused(llama_dir):
    """(FP8 MoE checkpoints and FP8 experts on the fused kernels: tests/test_moe_fp8.py.)"""
    with pytest.raises(ConfigError, match="enable_expert_parallel needs a mixture-of-experts model"):
        EngineArgs(model=llama_dir, tensor_parallel_size=2, enable_expert_parallel=True).create_engine_config()


def test_bench_latency_reports_tokens_per_expert(moe_dirs, tmp_path):
    """`llmserve bench latency --count-expert-tokens`: each sparse layer's tokens per expert (every
    token counted once per expert it picked: a multiple of top_k; the last layer's MLP runs only on
    the rows that sample, fewer than the others') and the busiest expert over the mean; without the
    flag, no count."""
    from llmserve.cli import main

    out = tmp_path / "lat.json"
    args = ["bench", "latency", "--model", moe_dirs["qwen3_moe"], "--max-model-len", "64", "--batch-size", "2",
            "--input-len", "8", "--output-len", "3", "--num-iters", "1", "--num-iters-warmup", "0",
            "--output-json", str(out)]  # fmt: skip
    main([*args, "--count-expert-tokens"])
    load = json.loads(out.read_text())["expert_tokens"]
    assert set(load["per_layer"]) == {"0", "2"}  # layer 1 is dense
    first, last = (sum(load["per_layer"][k]) for k in ("0", "2"))
    assert all(len(c) == 8 for c in load["per_layer"].values()) and first % 2 == last % 2 == 0
    # top_k 2 times the tokens: the TTFT run (2 prompts of 8) and the timed run (2 x (8 + 2 decodes))
    assert first == 2 * (2 * 8 + 2 * (8 + 2)) and 0 < last < first
    assert load["worst_max_over_mean"] >= 1.0
    main(args)
    assert json.loads(out.read_text())["expert_tokens"] is None
