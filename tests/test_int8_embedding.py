"""The embedding in int8 (`--int8-embedding` with `--quantization int8`, model/int8_embedding.py):
rows within half a step of their scale of the float table, looked up as the dequantized rows; a tied
LM head's logits those of the dequantized table, chunk by chunk; the engine equal to the float
model holding the dequantized rows (tied and untied heads), the memory saved logged, a checkpoint
written with `--int8-embedding` loading bit-equal to quantizing at load, over two ranks with a
vocabulary padded on the last rank, and the flag refused without int8 projections."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from llmserve import LLM, SamplingParams
from llmserve.config import ConfigError, EngineArgs
from llmserve.model import int8_embedding
from llmserve.model.int8 import dequantize_int8, quantize_rows_int8
from llmserve.model.int8_checkpoint import EMBEDDING_KEY
from llmserve.model.int8_embedding import Int8VocabParallelEmbedding, embedding_bytes
from llmserve.model.random_model import make_random_model
from llmserve.model.tensor_parallel import SINGLE

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [1, 5 + i, 9, 33, 70 + i] * (1 + 2 * (i % 2))} for i in range(3)]


def _table(vocab: int = 300, hidden: int = 64) -> tuple[torch.Tensor, Int8VocabParallelEmbedding]:
    w = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 0, vocab)[:, None]
    emb = Int8VocabParallelEmbedding(vocab, hidden, SINGLE, torch.float32)
    q, scale = quantize_rows_int8(w)
    emb.weight.data.copy_(q)
    emb.weight_scale.data.copy_(scale)
    return w, emb


def test_rows_are_looked_up_dequantized_within_half_a_step(monkeypatch):
    w, emb = _table()
    ids = torch.tensor([0, 7, 299, 7, 150])
    rows = emb(ids)
    deq = dequantize_int8(emb.weight, emb.weight_scale)
    assert rows.dtype == torch.float32 and torch.equal(rows, deq[ids])
    assert ((rows - w[ids]).abs() <= emb.weight_scale[ids] / 2 + 1e-7).all()  # each row its own scale
    assert (emb.weight_scale[:10] < emb.weight_scale[-10:].min()).all()  # small rows keep small steps
    # a tied LM head: the dequantized table's logits, in chunks of rows (three here, the last short)
    monkeypatch.setattr(int8_embedding, "LOGIT_ROWS", 128)
    h = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(emb.logits(h), F.linear(h, deq), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        emb.logits(h, torch.ones(300, 64)), h.sum(-1, keepdim=True).expand(4, 300)
    )  # untied: its own rows
    assert embedding_bytes(emb) == (300 * 64 + 300 * 4, 300 * 64 * 4)
    bf16 = Int8VocabParallelEmbedding(300, 64, SINGLE, torch.bfloat16)
    bf16.load_state_dict(emb.state_dict())
    assert bf16(ids).dtype == torch.bfloat16 and torch.equal(bf16(ids), deq[ids].to(torch.bfloat16))


def _with_embedding(model_dir: Path, out: Path) -> str:
    """A copy of the float folder whose embedding holds the int8 rows, dequantized."""
    shutil.copytree(model_dir, out)
    tensors = load_file(str(out / "model.safetensors"))
    tensors["model.embed_tokens.weight"] = dequantize_int8(*quantize_rows_int8(tensors["model.embed_tokens.weight"]))
    save_file(tensors, str(out / "model.safetensors"))
    return str(out)


@pytest.mark.parametrize("family", ["qwen2", "llama"], ids=["tied", "untied"])
def test_the_engine_gives_the_tokens_of_the_dequantized_table(tmp_path, caplog, family):
    model = make_random_model(tmp_path / family, family, seed=6, tie_word_embeddings=family == "qwen2")
    with caplog.at_level("INFO", logger="llmserve.model.int8_embedding"):
        llm = LLM(str(model), max_model_len=64, quantization="int8", int8_embedding=True)
    runner = llm.core.runner.model
    emb = runner.model.embed_tokens
    assert isinstance(emb, Int8VocabParallelEmbedding) and emb.weight.dtype == torch.int8
    assert emb.weight_scale.dtype == torch.float32 and runner.embedding_dtype() == torch.float32
    if family == "llama":
        assert runner.lm_head.weight.dtype == torch.float32  # an untied LM head stays in the model's dtype
    saved = "the tied LM head reads the same rows" if family == "qwen2" else "the LM head stays in the model's dtype"
    assert f"INT8 embedding: 512 x 64 rows in int8 with a float32 scale each, 0.0 MB against 0.1 MB in float32 " \
           f"(0.1 MB saved; {saved})" in caplog.text  # fmt: skip
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    twin = LLM(_with_embedding(model, tmp_path / "twin"), max_model_len=64, quantization="int8")
    assert got == [o.outputs[0].token_ids for o in twin.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_a_checkpoint_with_an_int8_embedding_over_two_ranks(tmp_path):
    """`make-int8-checkpoint --int8-embedding`: the rows and their scales stored, the config says so
    and the engine takes it without the flag; equal to quantizing at load, in one process and over
    two ranks (a vocabulary of 509: the last rank's rows padded)."""
    from llmserve.cli import main

    model = make_random_model(tmp_path / "m", "qwen2", seed=7, vocab_size=509, tie_word_embeddings=True)
    path = tmp_path / "int8"
    main(["make-int8-checkpoint", str(model), str(path), "--int8-embedding"])
    tensors = load_file(str(path / "model.safetensors"))
    assert tensors["model.embed_tokens.weight"].dtype == torch.int8
    assert tensors["model.embed_tokens.weight_scale"].shape == (509, 1)
    assert json.loads((path / "config.json").read_text())["quantization_config"][EMBEDDING_KEY] is True
    assert EngineArgs(model=str(path)).create_engine_config().model_config.int8_embedding
    with LLM(str(model), max_model_len=64, quantization="int8", int8_embedding=True) as at_load:
        want = [o.outputs[0].token_ids for o in at_load.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with LLM(str(path), max_model_len=64) as one, LLM(str(path), max_model_len=64, tensor_parallel_size=2) as two:
        emb = two.core.runner.model.model.embed_tokens
        assert emb.weight.shape == (255, 64) and emb.weight_scale.shape == (255, 1)  # rank 0: rows 0..254
        assert [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
        assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, GREEDY, use_tqdm=False)] == want


def test_the_flag_needs_int8_projections(llama_dir):
    with pytest.raises(ConfigError, match="int8_embedding goes with quantization int8"):
        EngineArgs(model=llama_dir, int8_embedding=True).create_engine_config()
    with pytest.raises(ConfigError, match="quantization is fp8"):
        EngineArgs(model=llama_dir, quantization="fp8", int8_embedding=True).create_engine_config()
    assert not EngineArgs(model=llama_dir, quantization="int8").create_engine_config().model_config.int8_embedding
