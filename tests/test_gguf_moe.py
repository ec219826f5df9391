"""Mixtures of experts from GGUF (issue 52): tiny random Qwen3-MoE and Qwen2-MoE folders written as
GGUF files (experts stacked per part, `blk.N.ffn_{gate,up,down}_exps`, the router `ffn_gate_inp`,
Qwen2-MoE's shared expert `*_shexp`) give the greedy tokens of transformers loading the same file
(float32); a Mixtral GGUF (`llama` with experts, which transformers does not load) gives llmserve's
tokens on the safetensors folder it was written from; an unknown expert layout is refused at start,
naming the tensor."""

from __future__ import annotations

import re

import pytest
from test_gguf import _prompts, hf_gguf_greedy, llmserve_greedy

from llmserve import SamplingParams
from llmserve.config import ConfigError, EngineArgs
from llmserve.model.gguf import writer
from llmserve.model.gguf.checkpoint import GGUFError
from llmserve.model.gguf.writer import write_gguf
from llmserve.model.random_model import make_random_model

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# transformers reads neither the experts' width nor the shared expert's from a GGUF: it takes the
# families' defaults (Qwen3-MoE 768, Qwen2-MoE 1408 and 5632), so the folders are that wide
SHAPES = {
    "qwen3_moe": dict(moe_intermediate_size=768, num_hidden_layers=2),
    "qwen2_moe": dict(moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_hidden_layers=2),
}


@pytest.mark.parametrize("family, tensor_type", [("qwen3_moe", "Q8_0"), ("qwen2_moe", "F32")])
def test_moe_ggufs_equal_transformers(tmp_path, family, tensor_type):
    folder = make_random_model(tmp_path / family, family, seed=8, **SHAPES[family])
    path = write_gguf(folder, tmp_path / f"{family}.gguf", tensor_type)
    arch = EngineArgs(model=str(path)).create_engine_config().model_config.arch
    assert (arch.num_experts, arch.top_k, arch.moe_intermediate_size) == (8, 2, SHAPES[family]["moe_intermediate_size"])
    assert arch.shared_expert_intermediate_size == SHAPES[family].get("shared_expert_intermediate_size", 0)
    prompts = _prompts(2)
    ours, theirs = llmserve_greedy(str(path), prompts, GREEDY), hf_gguf_greedy(path, prompts, GREEDY.max_tokens)
    for a, b in zip(ours, theirs, strict=True):  # transformers stops at the end-of-text token (2); llmserve goes on
        assert a[: len(b)] == b and (len(b) == len(a) or b[-1] == 2)


def test_a_mixtral_gguf_equals_its_safetensors_folder(tmp_path):
    """llama.cpp writes Mixtral as `llama` with experts (q/k rows reordered as Llama's); transformers
    has no expert mapping for `llama` GGUFs, so the oracle is llmserve on the folder."""
    folder = make_random_model(tmp_path / "mixtral", "mixtral", seed=9, sliding_window=None)
    path = write_gguf(folder, tmp_path / "mixtral.gguf", "F32")
    arch = EngineArgs(model=str(path)).create_engine_config().model_config.arch
    assert arch.architecture == "MixtralForCausalLM" and (arch.num_experts, arch.top_k) == (8, 2)
    prompts = _prompts(3)
    assert llmserve_greedy(str(path), prompts, GREEDY) == llmserve_greedy(str(folder), prompts, GREEDY)


def test_an_unknown_expert_layout_is_refused_naming_the_tensor(tmp_path, monkeypatch):
    """Experts one tensor each (`blk.0.ffn_gate.3.weight`, an older llama.cpp layout) and a
    stacked tensor of the wrong rank are refused at start."""
    folder = make_random_model(tmp_path / "q3", "qwen3_moe", seed=8, num_hidden_layers=1)
    name = writer.gguf_tensor_name
    per_expert = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")

    def old_names(hf: str) -> str:
        m = per_expert.fullmatch(hf)
        return f"blk.{m[1]}.ffn_{m[3]}.{m[2]}.weight" if m else name(hf)

    monkeypatch.setattr(writer, "_PER_EXPERT", re.compile(r"(?!)"))  # experts written one by one
    monkeypatch.setattr(writer, "gguf_tensor_name", old_names)
    path = write_gguf(folder, tmp_path / "per_expert.gguf")
    with pytest.raises(
        (ConfigError, GGUFError), match=r"GGUF tensor 'blk\.0\.ffn_gate\.\d+\.weight': experts stored one tensor each"
    ):
        EngineArgs(model=str(path)).create_engine_config()
    monkeypatch.undo()
    import gguf

    count = gguf.GGUFWriter.add_expert_count
    monkeypatch.setattr(gguf.GGUFWriter, "add_expert_count", lambda self, n: count(self, 6))  # the metadata lies
    six = write_gguf(folder, tmp_path / "six.gguf")
    with pytest.raises((ConfigError, GGUFError), match=r"GGUF tensor 'blk\.0\.ffn_gate_exps\.weight' holds 8 for qwen3moe.expert_count, "
                       "which says 6"):  # fmt: skip
        EngineArgs(model=str(six)).create_engine_config()
