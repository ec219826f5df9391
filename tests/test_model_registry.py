"""The model interface and registry (issue 50): families found by their checkpoints' names, their
declarations, and the boundary that keeps model shapes inside `llmserve/model/`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from llmserve.config import ConfigError
from llmserve.model.arch import SLIDING, UnsupportedModelError, parse_model_arch
from llmserve.model.interface import LinearSpec
from llmserve.model.registry import families, family_for_config, family_for_gguf, family_of

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent / "llmserve"
# a Llama-shaped model's module names: none may appear in code outside llmserve/model/
LLAMA_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj",
               "self_attn", "input_layernorm", "post_attention_layernorm", "embed_tokens", "lm_head")  # fmt: skip

GEMMA3_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 1000, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 32, "sliding_window": 32, "query_pre_attn_scalar": 32, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0, "hidden_activation": "gelu_pytorch_tanh",
}  # fmt: skip


def _code_names(path: Path) -> list[tuple[int, str]]:
    """Identifiers and string constants (docstrings aside) of a module that name a Llama module."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}  # fmt: skip
    pattern = re.compile(r"\b(" + "|".join(LLAMA_NAMES) + r")\b")
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            hits += [(node.lineno, m) for m in pattern.findall(node.value)]
        elif isinstance(node, ast.Attribute) and node.attr in LLAMA_NAMES:
            hits.append((node.lineno, node.attr))
        elif isinstance(node, ast.Name) and node.id in LLAMA_NAMES:
            hits.append((node.lineno, node.id))
    return hits


def test_nothing_outside_model_names_a_llama_module():
    found = {str(p.relative_to(ROOT)): hits for p in sorted(ROOT.rglob("*.py"))
             if p.relative_to(ROOT).parts[0] != "model" and (hits := _code_names(p))}  # fmt: skip
    assert found == {}


def test_lora_reaches_models_only_through_the_interface():
    allowed = {"llmserve.model.interface", "llmserve.model.registry"}
    imports = {}
    for path in sorted((ROOT / "lora").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llmserve.model"):
                imports.setdefault(path.name, set()).add(node.module)
    assert {name: mods - allowed for name, mods in imports.items() if mods - allowed} == {}


def test_families_are_found_by_their_names():
    names = {f.name for f in families()}
    assert {"Llama", "Gemma 3"} <= names
    for architecture in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert family_for_config({"architectures": [architecture]}).name == "Llama"
    assert family_for_config({"architectures": ["Gemma3ForConditionalGeneration"]}).name == "Gemma 3"
    assert family_for_config({"model_type": "gemma3_text"}).name == "Gemma 3"
    assert family_for_gguf("gemma3").name == "Gemma 3"
    assert family_for_gguf("qwen2").name == "Llama"
    assert family_for_gguf("mamba") is None
    with pytest.raises(UnsupportedModelError, match="supported: LlamaForCausalLM.*Gemma3ForCausalLM"):
        family_for_config({"architectures": ["FalconForCausalLM"]})


def test_every_family_declares_consistent_shapes():
    configs = [GEMMA3_CONFIG, {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
                               "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
                               "num_key_value_heads": 2}]  # fmt: skip
    for cfg in configs:
        arch = parse_model_arch(cfg)
        family = family_of(arch)
        specs = family.linears(arch)
        assert all(isinstance(s, LinearSpec) and len(s.parts) == len(s.widths) for s in specs)
        assert len({s.path for s in specs}) == len(specs)
        attention = family.attention(arch)
        assert len(attention) == arch.num_layers
        assert all(a.num_heads * a.head_dim == arch.q_size and a.num_kv_heads == arch.num_kv_heads for a in attention)


def test_gemma3_config_reads_windows_ropes_and_scales():
    arch = parse_model_arch(GEMMA3_CONFIG)
    assert arch.family == "gemma3" and arch.hidden_act == "gelu_pytorch_tanh"
    # five of every six layers slide (transformers' default pattern), the sixth is global
    assert [arch.layer_window(i) for i in range(7)] == [32, 32, 32, 32, 32, None, 32]
    assert arch.layer_types[0] == SLIDING
    assert arch.rope.theta == 1_000_000.0 and arch.rope_local.theta == 10_000.0
    assert arch.query_pre_attn_scalar == 32 and arch.tie_word_embeddings and arch.qk_norm
    # transformers 5's per-layer-type rope spelling and the multimodal wrapper's text_config
    wrapped = {"architectures": ["Gemma3ForConditionalGeneration"],
               "text_config": {**GEMMA3_CONFIG, "rope_parameters": {
                   "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}}  # fmt: skip
    arch = parse_model_arch(wrapped)
    assert arch.architecture == "Gemma3ForConditionalGeneration"
    assert (arch.rope.rope_type, arch.rope.factor, arch.rope_local.rope_type) == ("linear", 8.0, "default")
    with pytest.raises(UnsupportedModelError, match="attn_logit_softcapping"):
        parse_model_arch({**GEMMA3_CONFIG, "attn_logit_softcapping": 50.0})


def test_a_refused_feature_is_an_error_at_start(tmp_path):
    from llmserve.config import EngineArgs
    from llmserve.model.random_model import make_random_model

    folder = make_random_model(tmp_path / "gemma3", "gemma3", config_only=True)
    with pytest.raises(ConfigError, match="Gemma 3 models do not support lora"):
        EngineArgs(model=str(folder), enable_lora=True, load_format="dummy").create_engine_config()
