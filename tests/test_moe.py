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
        (dict(quantization="fp8"), "Qwen3-MoE models do not support quantization: FP8 experts"),
        (dict(tensor_parallel_size=2), "Qwen3-MoE models do not support tensor parallel"),
    ],
)
def test_refused_features_are_errors_at_start(tmp_path, option, message):
    folder = make_random_model(tmp_path / "q3", "qwen3_moe", config_only=True)
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
